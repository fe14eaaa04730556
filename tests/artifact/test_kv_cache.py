"""The runners' KV caches (``FusedLM`` + ``DeviceKV``, ``PortableLM`` + ``KVBuffers``), each
over 200+ decode steps: every step's logits equal torch's, across a capacity growth and a slot
compaction; chunked prefill; shrinking; and a new cache never inherits a stale binding."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from export_matrix import LOGIT_TOL

from kvserve.artifact.fused import CAPACITY_CHUNK
from kvserve.model.generate import generate

STEPS = 210
PROMPT_LENGTHS = (5, 40, 17)  # the longest reaches 250 rows: one growth, 128 -> 256


def _prompts(vocab: int) -> list[list[int]]:
    g = np.random.default_rng(7)
    return [g.integers(0, vocab, n).tolist() for n in PROMPT_LENGTHS]


def _start(lm, model, prompts):
    kv = lm.new_cache(len(prompts))
    lm.prefill(kv, 0, prompts)
    return kv


_REF = {}


def _reference(model, prompts):
    key = id(model)
    if key not in _REF:
        _REF[key] = generate(model, prompts, STEPS + 1, keep_logits=True)  # torch, greedy
    return _REF[key]


def test_reference_is_full_forward(main_model):
    """The cached torch reference agrees with a plain full forward (spot checks)."""
    prompts = _prompts(main_model.cfg.vocab_size)
    ref = _reference(main_model, prompts)
    for b, p in enumerate(prompts):
        for step in (0, 99, STEPS):
            seq = list(p) + ref.tokens[b][:step]
            with torch.no_grad():
                want = main_model(torch.tensor([seq])).logits[0, -1].numpy()
            assert np.abs(ref.logits[b][step] - want).max() <= LOGIT_TOL


def test_a_failed_run_leaves_the_cache_as_it_was(main_model, lm, monkeypatch):
    """onnxruntime raising in a step or a prefill leaves ``kv.used`` as it was, and the next
    step continues as if the failed call never happened (the engine fails the requests in
    flight and goes on)."""
    import onnxruntime as ort
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    prompts = _prompts(main_model.cfg.vocab_size)
    ref = _reference(main_model, prompts)
    B = len(prompts)
    kv = _start(lm, main_model, prompts)
    before = kv.used.copy()
    fresh = lm.new_cache(1)

    def boom(*a, **k):
        raise RuntimeError("injected onnxruntime failure")

    tokens = [ref.tokens[b][0] for b in range(B)]
    with monkeypatch.context() as m:
        m.setattr(ort.InferenceSession, "run_with_iobinding", boom)
        # (the fused runner calls onnxruntime's C++ session directly: artifact.providers)
        m.setattr(C.InferenceSession, "run_with_iobinding", boom)
        m.setattr(ort.InferenceSession, "run", boom)  # (the portable prefill's call)
        for call in (lambda: lm.decode(kv, B, tokens), lambda: lm.prefill(fresh, 0, prompts[:1])):
            try:
                call()
            except RuntimeError as e:
                assert "injected" in str(e)
            else:
                raise AssertionError("the injected failure did not reach the caller")
    assert (kv.used == before).all() and fresh.used[0] == 0
    logits, _ = lm.decode(kv, B, tokens)
    for b in range(B):
        assert np.abs(logits[b] - ref.logits[b][1]).max() <= LOGIT_TOL
    assert list(kv.used[:B]) == [n + 1 for n in PROMPT_LENGTHS]


def test_200_steps_across_capacity_growth(main_model, lm):
    prompts = _prompts(main_model.cfg.vocab_size)
    ref = _reference(main_model, prompts)
    B = len(prompts)
    kv = _start(lm, main_model, prompts)
    assert kv.capacity == CAPACITY_CHUNK
    generations = {kv.generation}
    worst = 0.0
    for step in range(STEPS):
        tokens = np.array([ref.tokens[b][step] for b in range(B)], dtype=np.int64)
        logits, _ = lm.decode(kv, B, tokens)
        generations.add(kv.generation)
        for b in range(B):
            d = float(np.abs(logits[b] - ref.logits[b][step + 1]).max())
            worst = max(worst, d)
            assert d <= LOGIT_TOL, (step, b, d)
            assert int(np.argmax(logits[b])) == ref.tokens[b][step + 1], (step, b)
    assert kv.capacity == 2 * CAPACITY_CHUNK and len(generations) == 2  # grew exactly once
    assert list(kv.used[:B]) == [n + STEPS for n in PROMPT_LENGTHS]
    print(f"max |Δlogit| over {STEPS} steps x {B} rows: {worst:.2e}")


def test_slot_compaction_keeps_results(main_model, lm):
    """The longest sequence (slot 1) leaves after the growth; the last one (slot 2) moves into
    its slot (whose rows beyond the moved length still hold the old, longer sequence) and
    goes on exactly as if it had never moved."""
    prompts = _prompts(main_model.cfg.vocab_size)
    ref = _reference(main_model, prompts)
    leave_at = 120  # slot 1 then has 160 rows (> CAPACITY_CHUNK), slot 2 has 137
    kv_a = _start(lm, main_model, prompts)  # never compacted
    kv_b = _start(lm, main_model, prompts)  # compacted at leave_at
    order = [0, 1, 2]  # sequence held by each slot of kv_b
    worst = 0.0
    for step in range(STEPS):
        if step == leave_at:
            assert kv_b.capacity == 2 * CAPACITY_CHUNK
            kv_b.move(2, 1)
            order = [0, 2]
            assert kv_b.used[1] == PROMPT_LENGTHS[2] + leave_at
        tok_a = np.array([ref.tokens[s][step] for s in range(3)], dtype=np.int64)
        la, _ = lm.decode(kv_a, 3, tok_a)
        la = la.copy()
        tok_b = np.array([ref.tokens[s][step] for s in order], dtype=np.int64)
        lb, _ = lm.decode(kv_b, len(order), tok_b)
        for slot, s in enumerate(order):
            want = ref.logits[s][step + 1]
            assert np.abs(lb[slot] - want).max() <= LOGIT_TOL, (step, s)
            d = float(np.abs(lb[slot] - la[s]).max())
            worst = max(worst, d)
            assert d <= 1e-6, (step, s)  # same as the unmoved run
            assert int(np.argmax(lb[slot])) == ref.tokens[s][step + 1]
    print(f"compacted vs uncompacted: max |Δlogit| {worst:.2e}")


def test_new_buffers_never_reuse_a_stale_binding(main_model, lm):
    """Regression: bindings were cached under (graph, n, generation, id(kv)) and every new
    cache started at generation 1; CPython hands a new object the id of a freed one, so a
    new cache (the engine makes one per scoring request, with its own capacity) could run
    on the freed buffers of an old one. Short-lived buffers of varying capacity, one after
    the other: every first step must match torch (the old code failed ~7 in 30 here)."""
    cfg = main_model.cfg
    g = np.random.default_rng(3)
    for trial in range(30):
        prompt = g.integers(0, cfg.vocab_size, 4 + trial % 5).tolist()
        kv = lm.new_cache(1, capacity=CAPACITY_CHUNK * (1 + trial % 3))
        lm.prefill(kv, 0, [prompt])
        got = lm.decode(kv, 1, np.array([5]))[0][0].copy()
        del kv  # freed now (refcount): the next cache may get this one's id
        with torch.no_grad():
            want = main_model(torch.tensor([prompt + [5]])).logits[0, -1].numpy()
        assert np.abs(got - want).max() <= LOGIT_TOL, trial


def test_chunked_prefill_through_the_decode_graph(main_model, lm):
    """A long input fed in chunks (prefill, then ``extend`` with T > 1 tokens after the slot's
    rows, across a capacity growth) gives the full forward's logits, and decoding continues
    from the chunked cache."""
    g = np.random.default_rng(11)
    ids = g.integers(0, main_model.cfg.vocab_size, 200)
    with torch.no_grad():
        want = main_model(torch.tensor(ids[None])).logits[0].numpy()  # (200, V)
    kv = lm.new_cache(2)
    got = [lm.prefill(kv, 1, [ids[:40]]).logits[0]]  # slot 1: slot 0 stays empty
    for a, b in ((40, 100), (100, 101), (101, 200)):  # 200 rows > one capacity chunk
        got.append(lm.extend(kv, 1, ids[a:b]))
    assert np.abs(np.concatenate(got) - want).max() <= LOGIT_TOL
    assert kv.used[1] == 200 and kv.capacity > CAPACITY_CHUNK

    nxt = int(np.argmax(want[-1]))
    logits, _ = lm.decode(kv, 2, np.array([0, nxt]))
    with torch.no_grad():
        ref = main_model(torch.tensor(np.append(ids, nxt)[None])).logits[0, -1].numpy()
    assert np.abs(logits[1] - ref).max() <= LOGIT_TOL


def test_buffers_shrink_when_long_sequences_leave(main_model, lm):
    """The buffers shrink back once the long sequence is gone; the remaining sequence's results
    are unchanged. Portable: to the rows in use (every step attends over the whole capacity).
    Fused: only memory is at stake, so with hysteresis (shrunk when the rows in use fit in a
    quarter of the capacity, to twice them): a steady workload does not reallocate per
    request."""
    g = np.random.default_rng(5)
    long_ids = g.integers(0, main_model.cfg.vocab_size, 500)
    short_ids = g.integers(0, main_model.cfg.vocab_size, 6)
    kv = lm.new_cache(2)
    for slot, ids in ((0, short_ids), (1, long_ids)):
        lm.prefill(kv, slot, [ids])
    assert kv.capacity == 4 * CAPACITY_CHUNK
    kv.shrink_to_fit(2)  # both still there: nothing to give back
    assert kv.capacity == 4 * CAPACITY_CHUNK
    kv.shrink_to_fit(1)  # slot 1 (the long one) left
    after = 2 * CAPACITY_CHUNK if lm.kind == "fused" else CAPACITY_CHUNK
    assert kv.capacity == after and kv.used[1] == 0
    logits, _ = lm.decode(kv, 1, np.array([7]))
    with torch.no_grad():
        want = main_model(torch.tensor(np.append(short_ids, 7)[None])).logits[0, -1].numpy()
    assert np.abs(logits[0] - want).max() <= LOGIT_TOL
    kv.shrink_to_fit(0)
    assert kv.capacity == after  # a quarter of 256 rows is below one chunk: kept


def test_reserved_rows_are_room_without_reallocation(main_model, lm):
    """Fused: ``reserve`` grows the buffers once, decoding inside the reservation never
    reallocates, and a shrink keeps rows reserved for the sequences still there. Portable:
    every step attends over the whole capacity, so nothing is reserved."""
    kv = lm.new_cache(2)
    kv.reserve(600)
    if lm.kind != "fused":
        assert kv.capacity == CAPACITY_CHUNK
        return
    assert kv.capacity == 5 * CAPACITY_CHUNK
    gen = kv.generation
    ids = np.random.default_rng(6).integers(0, main_model.cfg.vocab_size, 6)
    lm.prefill(kv, 0, [ids])
    tok = np.array([3])
    for _ in range(150):  # past the first chunk of rows
        logits, _ = lm.decode(kv, 1, tok)
        tok = logits.argmax(-1)
    assert kv.generation == gen and kv.used[0] == 156
    kv.shrink_to_fit(1, keep_rows=600)
    assert kv.capacity == 5 * CAPACITY_CHUNK and kv.generation == gen
    kv.shrink_to_fit(1)  # nothing reserved: 157 rows are two chunks, over a quarter of 640
    assert kv.capacity == 5 * CAPACITY_CHUNK


def test_resizing_copies_only_the_slots_in_use(main_model, lm):
    """Fused: a growth or shrink copies the slots up to the last one holding rows, and nothing
    when no slot holds any (an idle engine admitting a request): with 16 slots and one
    sequence, the other 15 slots' rows are not moved. The rows that are copied are intact."""
    if lm.kind != "fused":
        return
    copied: list[int] = []
    resize = lm.ops.resize

    def recording(buf, capacity, slots):
        copied.append(slots)
        return resize(buf, capacity, slots)

    lm.ops.resize = recording
    try:
        kv = lm.new_cache(16)
        kv.reserve(300)  # empty: new buffers, nothing copied
        assert kv.capacity == 3 * CAPACITY_CHUNK and set(copied) == {0}
        ids = np.random.default_rng(8).integers(0, main_model.cfg.vocab_size, 20)
        lm.prefill(kv, 2, [ids])  # slot 2 (slots 0 and 1 stay empty)
        before = [kv.slot_rows(layer, 2) for layer in range(main_model.cfg.n_layers)]
        copied.clear()
        kv.reserve(700)
        assert kv.capacity == 6 * CAPACITY_CHUNK
        assert copied == [3] * (2 * main_model.cfg.n_layers)  # slots 0..2 of each buffer
        for layer, (k, v) in enumerate(before):
            k2, v2 = kv.slot_rows(layer, 2)
            assert np.array_equal(k, k2) and np.array_equal(v, v2)
        logits, _ = lm.decode(kv, 3, np.array([0, 0, 5]))
        with torch.no_grad():
            want = main_model(torch.tensor(np.append(ids, 5)[None])).logits[0, -1].numpy()
        assert np.abs(logits[2] - want).max() <= LOGIT_TOL
        copied.clear()
        kv.clear(2)
        kv.shrink_to_fit(0)  # nothing in use: new, smaller buffers, nothing copied
        assert kv.capacity == 2 * CAPACITY_CHUNK and set(copied) == {0}
    finally:
        lm.ops.resize = resize


def test_a_free_slot_retains_its_rows_for_the_next_sequence(main_model, lm):
    """A leaving sequence's slot keeps its rows (``retain``) across a growth and a shrink of
    the buffers; the next sequence in that slot takes them over (``reuse``) and continues from
    them with the logits of the whole prompt. A move into or out of the slot drops them."""
    V = main_model.cfg.vocab_size
    ids = np.random.default_rng(9).integers(0, V, 30).tolist()
    kv = lm.new_cache(3)
    lm.prefill(kv, 1, [ids])  # slot 1 (0 is empty: the copies cover the slots before it too)
    kv.retain(1, 25)
    kv.used[1] = 0  # free, as the scheduler leaves it
    assert kv.retained[1] == 25
    gen = kv.generation
    kv.ensure_capacity(5 * CAPACITY_CHUNK)  # a growth: new buffers, the retained rows copied
    kv.shrink_to_fit(0)  # and a shrink (fused: to twice a chunk; portable: one chunk)
    assert kv.generation >= gen + 2 and kv.capacity < 5 * CAPACITY_CHUNK
    assert kv.retained[1] == 25
    with pytest.raises(ValueError, match="retains 25"):
        kv.reuse(1, 26)
    kv.reuse(1, 25)
    assert kv.used[1] == 25 and kv.retained[1] == 0
    tail = [5, 6, 7]
    got = lm.extend(kv, 1, np.asarray(ids[25:] + tail, np.int64))
    with torch.no_grad():
        want = main_model(torch.tensor([ids + tail])).logits[0, 25:].numpy()
    assert np.abs(got - want).max() <= LOGIT_TOL
    kv.retain(1, 40)  # at most the rows it has
    assert kv.retained[1] == 33
    kv.move(2, 1)
    assert kv.retained[1] == 0 and kv.retained[2] == 0


def test_last_row_prefills_keep_their_binding(main_model, lm):
    """Fused: a last-row prefill's binding is kept per slot range and buffer generation; a
    prompt of another length binds new ids only. Prompts of 12, 30, 5 and 12 tokens into slot
    1 (after rows of its own for the third), each last row equal to torch's; the binding
    holds no ids of earlier lengths."""
    if lm.kind != "fused" or not lm.last_rows:
        return
    V = main_model.cfg.vocab_size
    g = np.random.default_rng(10)
    kv = lm.new_cache(2)
    bound = held = None
    for n, keep in ((12, 0), (30, 0), (5, 30), (12, 0)):
        kv.clear(1)
        before = g.integers(0, V, keep).tolist()
        ids = g.integers(0, V, n).tolist()
        if keep:  # rows of the slot's own, then the prompt after them
            lm.prefill(kv, 1, [before], last=True)
        got = lm.prefill(kv, 1, [ids], last=True).logits[0][-1]
        with torch.no_grad():
            want = main_model(torch.tensor([before + ids])).logits[0, -1].numpy()
        assert np.abs(got - want).max() <= LOGIT_TOL, n
        kept = lm._prefill_bound[(1, 1, kv.generation)]
        assert bound is None or kept is bound
        bound = kept
        if held is None:
            held = len(bound._values)
        assert len(bound._values) == held  # the latest ids only, whatever the lengths so far
    assert len(lm._prefill_bound) == 1


def test_bindings_built_counts_the_calls_that_paid_for_one(lm):
    """``bindings_built`` grows when a call builds an IO binding (a new batch size, new
    buffers), not when it reuses one: the engine leaves such calls out of its step costs."""
    kv = lm.new_cache(2)
    lm.prefill(kv, 0, [[5, 6, 7], [8, 9, 10]], last=True)
    before = lm.bindings_built
    lm.decode(kv, 2, [1, 2])
    assert lm.bindings_built == before + 1
    lm.decode(kv, 2, [3, 4])
    assert lm.bindings_built == before + 1  # (reused)
    lm.decode(kv, 1, [5])
    assert lm.bindings_built == before + 2  # (another batch size)

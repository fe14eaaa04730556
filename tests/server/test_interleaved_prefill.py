"""A long prompt fed a chunk per engine iteration (``Scheduler.prefilling``): the active
sequences step between its chunks, its rows and tokens are those of the uninterrupted prefill,
shorter prompts go before it or beside it, and a sequence leaving, a cancellation or a cached
prefix on the way changes nothing else."""
from __future__ import annotations

import numpy as np
from test_prefill_groups import _sched, _seqs
from test_speedups import LOGIT_TOL, lm  # noqa: F401  (lm: the module's fixture)

from kvserve.model.sampling import SamplingParams
from kvserve.server.detok import TokenBytes
from kvserve.server.domain import FinishEvent, FinishReason, GenerateRequest, OutputParams, \
    StopParams, TokenEvent
from kvserve.server.engine import Engine
from kvserve.server.scheduler import Prefilling

LONG = [(11 * i) % 280 + 9 for i in range(200)]  # 200 tokens: 13 chunks of 16
SHORT = [40, 41, 42, 43, 44, 45]


def _engine(lm, interleave: bool, prefix_mb: int = 0) -> Engine:
    V = lm.cfg.vocab_size  # chunks of 16 tokens (the logits cap: 16 x V floats)
    e = Engine(lm, TokenBytes.without_text(V), max_batch=4, max_queue=16,
               score_chunk_floats=16 * V, eos_id=None, prefix_cache_bytes=prefix_mb << 20,
               interleave_prefill=interleave)
    e.start()
    return e


def _req(prompt, n: int) -> GenerateRequest:
    return GenerateRequest(list(prompt), SamplingParams(),
                           StopParams(max_new_tokens=n, ignore_eos=True),
                           OutputParams(return_logits=True))


def _run(engine: Engine, prompts_n) -> list[tuple[list[int], list, FinishEvent]]:
    """The requests submitted together: each one's tokens, logits and finish."""
    out = []
    for evs in (list(h) for h in engine.submit_many([_req(p, n) for p, n in prompts_n])):
        toks = [e for e in evs if isinstance(e, TokenEvent)]
        out.append(([e.token_id for e in toks], [e.logits for e in toks],
                    next(e for e in evs if isinstance(e, FinishEvent))))
    return out


def _same(got, want) -> None:
    for (t, lg, _), (t2, lg2, _) in zip(got, want):
        assert t == t2
        for a, b in zip(lg, lg2):
            assert np.abs(np.asarray(a) - np.asarray(b)).max() <= \
                LOGIT_TOL * max(1.0, float(np.abs(np.asarray(b)).max()))


def _reference(lm, prompts_n, prefix_mb: int = 0):
    e = _engine(lm, False, prefix_mb)
    try:
        return _run(e, prompts_n)
    finally:
        e.stop()


def _calls(monkeypatch, lm) -> list[str]:
    """The model calls from now on: ``extend`` (a prompt's chunk after its first) or
    ``decode`` (a step of the active sequences)."""
    calls: list[str] = []
    for name in ("extend", "decode"):
        orig = getattr(lm, name)

        def spy(*a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(*a, **k)
        monkeypatch.setattr(lm, name, spy)
    return calls


def test_long_prompts_are_admitted_one_at_a_time_and_shorter_ones_beside_them():
    s = _sched(chunk=64)
    s.interleave = True
    for seq in _seqs(10, 200, 12, 300, 5):
        s.enqueue(seq)

    def take():
        return [len(x.prefill_ids) for x in s.take_admissions()]
    assert take() == [10, 200, 12, 5]  # one long prompt; the next keeps its turn
    assert [len(x.prefill_ids) for x in s.waiting] == [300]
    s.prefilling = Prefilling(_seqs(200)[0], 64, 64)  # (being fed)
    for seq in _seqs(7, 250):
        s.enqueue(seq)
    assert take() == [7]  # shorter ones beside it, the long ones wait in their order
    assert [len(x.prefill_ids) for x in s.waiting] == [300, 250]
    s.prefilling = None
    assert take() == [300]
    assert take() == [250]
    s.interleave = False
    for seq in _seqs(10, 200, 12, 300):
        s.enqueue(seq)
    assert len(s.take_admissions()) == 4
    # the slot the one being fed holds counts: with max_batch - 1 active, nothing more
    s.interleave = True
    s.active = _seqs(*[3] * 7)
    s.prefilling = Prefilling(_seqs(200)[0], 64, 64)
    s.enqueue(_seqs(4)[0])
    assert s.take_admissions() == []


def test_a_short_prompt_arriving_while_a_long_one_is_fed_starts_at_once(lm, monkeypatch):
    prompts = [(SHORT, 30), (LONG, 6)]
    late = ([7, 8, 9, 10], 12)
    e = _engine(lm, True)
    calls: list[str] = []
    inside: list[int] = []  # (extend calls prefill: those are not recorded again)
    for name in ("prefill", "extend"):
        orig = getattr(lm, name)

        def spy(kv, slot, ids, *a, _orig=orig, _name=name, **k):
            if not inside:
                calls.append(f"{_name} {slot}" + (f" x{len(ids[0])}" if _name == "prefill"
                                                  else ""))
            inside.append(1)
            try:
                return _orig(kv, slot, ids, *a, **k)
            finally:
                inside.pop()
        monkeypatch.setattr(lm, name, spy)
    handles: list = []

    def hook(work):  # (the engine's thread: the late request arrives while LONG is fed)
        work()
        if e.sched.prefilling is not None and not handles:
            handles.extend(e.submit_many([_req(*late)]))
    e.iteration_hook = hook
    try:
        got = _run(e, prompts)
        evs = list(handles[0])
        monkeypatch.undo()
        assert e.sched.prefilling is None
    finally:
        e.stop()
    # the short prompt first, the long one's first chunk after it (in slot 1); the late one,
    # admitted while the long one was fed, into slot 1 too, the long one's rows moving to
    # slot 2, where its next chunks went (back in slot 1 once the late one had left)
    assert calls[:4] == ["prefill 0 x6", "prefill 1 x16", "prefill 1 x4", "extend 2"]
    assert len(calls) == 3 + len(LONG) // 16 and set(calls[3:]) <= {"extend 1", "extend 2"}
    toks = [x.token_id for x in evs if isinstance(x, TokenEvent)]
    want = _reference(lm, [*prompts, late])
    _same(got, want[:2])
    assert toks == want[2][0]


def test_the_active_sequences_step_between_a_long_prompts_chunks(lm, monkeypatch):
    prompts = [(SHORT, 40), (LONG, 6)]
    e = _engine(lm, True)
    try:
        calls = _calls(monkeypatch, lm)
        got = _run(e, prompts)
        monkeypatch.undo()
        assert e.sched.prefilling is None
    finally:
        e.stop()
    first, last = calls.index("extend"), len(calls) - 1 - calls[::-1].index("extend")
    assert calls.count("extend") == 12  # the 12 chunks after the admission's first
    assert calls[first:last].count("decode") == 11  # a step between each two chunks
    _same(got, _reference(lm, prompts))


def test_a_sequence_leaving_while_a_prompt_is_fed_moves_that_prompts_slot(lm, monkeypatch):
    prompts = [(SHORT, 5), (LONG, 6), ([7, 8, 9], 30)]
    e = _engine(lm, True)
    moves: list[tuple[int, int, int]] = []  # (src, dst, rows moved)
    move = e.sched.kv.move

    def spy(src, dst):
        if e.sched.prefilling is not None:
            moves.append((src, dst, int(e.sched.kv.used[src])))
        move(src, dst)
    monkeypatch.setattr(e.sched.kv, "move", spy)
    try:
        got = _run(e, prompts)
    finally:
        e.stop()
    # the short one left after 5 tokens, in the long prompt's third chunk or so; that prompt
    # moved down a slot with its rows so far
    assert any(dst == src - 1 and 16 <= rows < len(LONG) for src, dst, rows in moves)
    _same(got, _reference(lm, prompts))


def test_a_prompt_cancelled_while_fed_frees_its_slot(lm):
    e = _engine(lm, True)
    handles: list = []
    fed: list[int] = []

    def hook(work):  # (the engine's thread, after each iteration: cancelled mid-prompt)
        work()
        if e.sched.prefilling is not None and handles and not fed:
            fed.append(e.sched.prefilling.at)
            handles[0].cancel()
    e.iteration_hook = hook
    try:
        handles.extend(e.submit_many([_req(LONG, 4)]))
        evs = list(handles[0])
        assert fed and 16 <= fed[0] < len(LONG)
        assert isinstance(evs[-1], FinishEvent) and evs[-1].reason is FinishReason.CANCELLED
        assert not [x for x in evs if isinstance(x, TokenEvent)]
        after = _run(e, [(SHORT, 5), (LONG, 3)])
        assert e.sched.prefilling is None and not e.sched.active
    finally:
        e.stop()
    _same(after, _reference(lm, [(SHORT, 5), (LONG, 3)]))


def test_a_long_prompt_after_a_cached_prefix_is_fed_the_same_way(lm, monkeypatch):
    prompts = [(SHORT, 30), (LONG[:40] + LONG, 4)]
    e = _engine(lm, True, prefix_mb=8)
    try:
        _run(e, [(LONG[:40] + [3], 1)])  # the prompt's first 40 tokens cached
        calls = _calls(monkeypatch, lm)
        got = _run(e, prompts)
        monkeypatch.undo()
    finally:
        e.stop()
    assert got[1][2].cached_tokens == 40
    first, last = calls.index("extend"), len(calls) - 1 - calls[::-1].index("extend")
    assert calls[first:last].count("decode") >= 10
    _same(got, _reference(lm, prompts))

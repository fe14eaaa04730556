"""The prefix pool's device copies (``kvserve.artifact.prefix_pool``) on both runners (``lm``:
fused ``llama`` through its two onnxruntime graphs — the code path CUDA runs — and portable
through numpy): rows saved and loaded bit for bit, one onnxruntime run per copy whatever the
blocks and layers, the refusals, and the exactness of a restored prefix (teacher-forced
logits and greedy tokens equal prefilling the whole prompt, within 1e-4)."""
from __future__ import annotations

import numpy as np
from onnxruntime.capi import onnxruntime_pybind11_state as C
import pytest
from export_matrix import LOGIT_TOL
from spec_testing import check_prefix_restore

from kvserve.artifact.prefix_pool import block_bytes, make_prefix_pool

BT = 16


def test_save_and_load_copy_rows_exactly(lm, monkeypatch):
    cfg = lm.cfg
    pool = make_prefix_pool(lm, 20 * block_bytes(cfg, BT, 4), BT)
    assert pool.n_blocks == 20 and pool.nbytes == 20 * block_bytes(cfg, BT, 4)
    kv = lm.new_cache(3)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, 70).tolist()
    lm.prefill(kv, 1, [ids[:30]], last=True)
    lm.prefill(kv, 2, [ids], last=True)  # 70 rows: blocks 0..3 full
    runs = []
    # (onnxruntime's C++ session class: the copies call it directly, artifact.providers)
    real = C.InferenceSession.run_with_iobinding
    monkeypatch.setattr(C.InferenceSession, "run_with_iobinding",
                        lambda self, b, *a: (runs.append(1), real(self, b, *a))[1])
    pool.save(kv, [(2, 0), (2, 2), (2, 3)], [17, 4, 9])  # any slot blocks, any pool blocks
    assert len(runs) == (1 if lm.kind == "fused" else 0)  # one run for all layers and blocks
    for layer in range(cfg.n_layers):
        k, v = kv.slot_rows(layer, 2) if lm.kind == "fused" else \
            (kv.k[layer][2, :, :70], kv.v[layer][2, :, :70])
        for j, bid in ((0, 17), (2, 4), (3, 9)):
            pk, pv = pool.block_rows(layer, bid)
            assert np.array_equal(pk, k[:, j * BT:(j + 1) * BT])
            assert np.array_equal(pv, v[:, j * BT:(j + 1) * BT])
    pool.save(kv, [(2, 4)], [1])  # rows 64..69 of 70: a block partly filled is saved whole
    for layer in range(cfg.n_layers):
        k, v = kv.slot_rows(layer, 2) if lm.kind == "fused" else \
            (kv.k[layer][2, :, :70], kv.v[layer][2, :, :70])
        pk, pv = pool.block_rows(layer, 1)
        assert np.array_equal(pk[:, :6], k[:, 64:70]) and np.array_equal(pv[:, :6], v[:, 64:70])
    with pytest.raises(ValueError, match="block 5 holds none"):
        pool.save(kv, [(2, 5)], [0])
    kv.clear(0)
    runs.clear()
    beside = [[x.copy() for x in kv.slot_rows(layer, 1)] for layer in range(cfg.n_layers)] \
        if lm.kind == "fused" else None
    pool.load(kv, 0, [4, 17, 9])  # slot 0: rows of blocks 2, 0, 3 in that order
    assert len(runs) == (1 if lm.kind == "fused" else 0) and kv.used[0] == 3 * BT
    for layer in range(cfg.n_layers):
        src = kv.slot_rows(layer, 2) if lm.kind == "fused" else \
            (kv.k[layer][2, :, :70], kv.v[layer][2, :, :70])
        dst = kv.slot_rows(layer, 0) if lm.kind == "fused" else \
            (kv.k[layer][0, :, :48], kv.v[layer][0, :, :48])
        for a, b in zip(src, dst):
            want = np.concatenate([a[:, 2 * BT:3 * BT], a[:, :BT], a[:, 3 * BT:4 * BT]], 1)
            assert np.array_equal(b, want)
        if lm.kind == "fused":  # slot 1, next to it, untouched
            for a, b in zip(kv.slot_rows(layer, 1), beside[layer]):
                assert a.shape[1] == 30 and np.array_equal(a, b)
    with pytest.raises(ValueError, match="empty slot"):
        pool.load(kv, 1, [0])


def test_one_save_copies_blocks_of_several_slots(lm, monkeypatch):
    """A save takes blocks of any slots in one run (a batched prefill's prompts, the
    sequences that leave at one step): each pool block gets exactly its slot's rows, in the
    order given, and the slots between them are not read into the wrong blocks."""
    cfg = lm.cfg
    pool = make_prefix_pool(lm, 12 * block_bytes(cfg, BT, 4), BT)
    kv = lm.new_cache(4)
    rng = np.random.default_rng(11)
    for slot, n in ((0, 40), (1, 16), (3, 70)):  # slot 2 stays empty
        lm.prefill(kv, slot, [rng.integers(0, cfg.vocab_size, n).tolist()], last=True)
    runs = []
    real = C.InferenceSession.run_with_iobinding
    monkeypatch.setattr(C.InferenceSession, "run_with_iobinding",
                        lambda self, b, *a: (runs.append(1), real(self, b, *a))[1])
    blocks = [(3, 3), (0, 1), (1, 0), (3, 0), (0, 0)]
    pool.save(kv, blocks, [7, 0, 11, 3, 5])
    assert len(runs) == (1 if lm.kind == "fused" else 0)
    for layer in range(cfg.n_layers):
        for (slot, j), bid in zip(blocks, [7, 0, 11, 3, 5]):
            k, v = kv.slot_rows(layer, slot) if lm.kind == "fused" else \
                (kv.k[layer][slot, :, :kv.used[slot]], kv.v[layer][slot, :, :kv.used[slot]])
            pk, pv = pool.block_rows(layer, bid)
            assert np.array_equal(pk, k[:, j * BT:(j + 1) * BT])
            assert np.array_equal(pv, v[:, j * BT:(j + 1) * BT])
    for bad, match in (([(2, 0)], "slot 2 has 0 rows"), ([(1, 1)], "block 1 holds none"),
                       ([(9, 0)], "no block 0 of slot 9")):
        with pytest.raises(ValueError, match=match):
            pool.save(kv, bad, [1])


def test_kept_copy_bindings_follow_slots_and_reallocated_buffers(lm):
    """The fused pool keeps each copy's binding per (buffer generation, slot): a copy from
    another slot, or after the KV buffers were reallocated (grown, shrunk), must read and
    write the rows there now, not where an earlier copy's binding pointed."""
    cfg = lm.cfg
    pool = make_prefix_pool(lm, 16 * block_bytes(cfg, BT, 4), BT)
    kv = lm.new_cache(3)
    rng = np.random.default_rng(9)

    def rows(slot, n):
        return [np.concatenate([x[:, :n] for x in (kv.slot_rows(layer, slot) if lm.kind ==
                                                   "fused" else (kv.k[layer][slot, :, :n],
                                                                 kv.v[layer][slot, :, :n]))])
                for layer in range(cfg.n_layers)]

    def block(bid):
        return [np.concatenate(pool.block_rows(layer, bid)) for layer in range(cfg.n_layers)]

    for round_ in range(3):
        for slot in (0, 2, 1):
            kv.clear(slot)
            lm.prefill(kv, slot, [rng.integers(0, cfg.vocab_size, 2 * BT).tolist()], last=True)
            bid = 3 * round_ + slot
            pool.save(kv, [(slot, 1)], [bid])
            want = [r[:, BT:2 * BT] for r in rows(slot, 2 * BT)]
            assert all(np.array_equal(a, b) for a, b in zip(block(bid), want))
            kv.clear(slot)
            pool.load(kv, slot, [bid])
            assert kv.used[slot] == BT
            assert all(np.array_equal(a, b) for a, b in zip(rows(slot, BT), want))
        generation = getattr(kv, "generation", None)
        kv.ensure_capacity(kv.capacity + 1)  # new buffers: the kept bindings must not be used
        assert getattr(kv, "generation", None) != generation or generation is None


def test_block_size_must_divide_the_capacity_chunk(lm):
    with pytest.raises(ValueError, match="block_tokens must divide 128"):
        make_prefix_pool(lm, 1 << 20, 24)
    assert make_prefix_pool(lm, 10, BT) is None  # not one block: the cache is off


def test_restored_prefix_equals_prefilling_the_whole_prompt(lm):
    worst = max(check_prefix_restore(lm, LOGIT_TOL, seed) for seed in range(2))
    print(f"{lm.kind}: restored prefix vs whole prefill, max relative |Δlogit| {worst:.2e}")


def test_touch_zeroes_exactly_the_blocks_asked_for(lm):
    """``touch`` (the prefix cache's warming of free blocks) writes zeros into those blocks of
    every layer's K and V and nothing else: saved blocks around them keep their rows bit for
    bit; out-of-range blocks are refused."""
    cfg = lm.cfg
    pool = make_prefix_pool(lm, 12 * block_bytes(cfg, BT, 4), BT)
    assert pool.lazy  # (host memory on the CPU provider)
    kv = lm.new_cache(1)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, 64).tolist()
    lm.prefill(kv, 0, [ids], last=True)  # 4 full blocks
    pool.save(kv, [(0, 0), (0, 1), (0, 2), (0, 3)], [2, 5, 6, 11])
    kept = {b: [pool.block_rows(layer, b) for layer in range(cfg.n_layers)]
            for b in (2, 5, 6, 11)}
    pool.touch([3, 4, 7, 8, 9, 10, 0])  # runs 0, 3-4 and 7-10, around the saved blocks
    for layer in range(cfg.n_layers):
        for b in (0, 3, 4, 7, 8, 9, 10):
            k, v = pool.block_rows(layer, b)
            assert not k.any() and not v.any()
        for b, rows in kept.items():
            k, v = pool.block_rows(layer, b)
            assert np.array_equal(k, rows[layer][0]) and np.array_equal(v, rows[layer][1])
    with pytest.raises(ValueError, match="out of range"):
        pool.touch([11, 12])

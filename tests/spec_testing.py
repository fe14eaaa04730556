"""Shared checks of the speculation and prefix-cache components against the plain path, run
on the artifact tests' runners (fused and portable) and on the export matrix's configs.

The plain path is the runner itself: a prefill of the prompt, then one decode step per token
(the engine's path today), on a cache of its own."""
from __future__ import annotations

import numpy as np


def plain_logits(lm, prompt: list[int], fed: list[int]) -> np.ndarray:
    """Logits (len(fed), V) of decoding ``fed`` one token per step after ``prompt``."""
    kv = lm.new_cache(1)
    lm.prefill(kv, 0, [prompt], last=True)
    out = []
    for tok in fed:
        logits, _ = lm.decode(kv, 1, [tok])
        out.append(logits[0].copy())
    return np.stack(out)


def check_verify_teacher_forced(lm, tol: float, seed: int = 0) -> float:
    """A batch of 4 slots (prompts of different lengths) verified twice in a row with drafts
    of different lengths per row (0 .. 6, right-padded in one call), each verification
    followed by a truncate that keeps a different number of accepted rows; then a plain decode
    step. Every verified row and the final step equal the plain path's logits within ``tol``
    (relative to the largest |logit| of the reference). Returns the worst difference."""
    g = np.random.default_rng(seed)
    V = lm.cfg.vocab_size
    prompts = [g.integers(0, V, n).tolist() for n in (9, 3, 17, 5)]
    n = len(prompts)
    kv = lm.new_cache(n)
    lm.prefill(kv, 0, prompts, last=True)
    history = [list(p) for p in prompts]  # tokens whose rows the slot keeps
    worst = 0.0
    for round_, (lens, keep) in enumerate((([1, 4, 7, 3], [1, 2, 7, 0]),
                                           ([6, 1, 2, 5], [6, 1, 1, 3]))):
        rows = [g.integers(0, V, m).tolist() for m in lens]
        before = kv.used[:n].copy()
        logits = lm.verify(kv, n, rows).copy()
        assert logits.shape == (n, max(lens), V)
        assert list(kv.used[:n]) == [u + m for u, m in zip(before, lens)]
        for b in range(n):
            want = plain_logits(lm, history[b], rows[b])
            scale = max(1.0, float(np.abs(want).max()))
            d = float(np.abs(logits[b, :lens[b]] - want).max()) / scale
            worst = max(worst, d)
            assert d <= tol, (round_, b, d)
            if keep[b]:  # keep the fed token and keep[b] - 1 draft tokens
                kv.truncate(b, int(before[b]) + keep[b])
                history[b] += rows[b][:keep[b]]
            else:  # a row that kept nothing (an engine never does; truncate allows it)
                kv.truncate(b, int(before[b]))
    nxt = g.integers(0, V, n).tolist()
    logits, _ = lm.decode(kv, n, nxt)
    for b in range(n):
        want = plain_logits(lm, history[b], [nxt[b]])[0]
        scale = max(1.0, float(np.abs(want).max()))
        d = float(np.abs(logits[b] - want).max()) / scale
        worst = max(worst, d)
        assert d <= tol, ("after truncate", b, d)
    return worst


def check_greedy_speculation(lm, prompt: list[int], steps: int, k: int = 4) -> list[int]:
    """Greedy generation through ``verify`` with n-gram drafts equals plain greedy decoding
    token for token. Returns the tokens."""
    from kvserve.server.ngram import NgramIndex
    from kvserve.server.spec_verify import verify_row

    kv = lm.new_cache(1)
    first = lm.prefill(kv, 0, [prompt], last=True).logits[0][-1]
    want = [int(np.argmax(first))]
    pk = lm.new_cache(1)
    lm.prefill(pk, 0, [prompt], last=True)
    while len(want) < steps:
        logits, _ = lm.decode(pk, 1, [want[-1]])
        want.append(int(np.argmax(logits[0])))
    got = [want[0]]
    index = NgramIndex(prompt + got)  # (lengths 1, 2, 3, 8: a single-token match drafts too)
    while len(got) < steps:
        draft = index.propose(k)
        used = int(kv.used[0])
        logits = lm.verify(kv, 1, [[got[-1], *draft]])[0]
        emitted = verify_row(logits, draft, lambda j, row: int(np.argmax(row)))
        kv.truncate(0, used + len(emitted))
        for tok in emitted:
            got.append(tok)
            index.append(tok)
    assert got[:steps] == want, (got, want)
    return want


def prefill_rest(lm, kv, slot: int, rest: list[int]) -> np.ndarray:
    """The rest of a prompt after the slot's restored rows: all its logits (T, V). Both
    runners' ``extend`` continue after the slot's rows (the portable ``prefill`` would
    replace them; the fused one continues too, and batches slots)."""
    return lm.extend(kv, slot, rest)


def check_prefix_restore(lm, tol: float, seed: int = 0) -> float:
    """A prompt prefilled in slot 1 (slot 0 busy with another) and inserted; a second prompt
    sharing its first 40 tokens restores them (two whole blocks and the first 8 rows of a
    third) into an empty slot of another cache and prefills the rest. Its logits (rest rows) and 4 greedy decode steps equal those
    of prefilling the second prompt whole, within ``tol`` (relative to the largest |logit|);
    the greedy tokens are identical. Returns the worst difference."""
    from kvserve.artifact.prefix_pool import make_prefix_pool
    from kvserve.server.prefix_cache import PrefixCache

    g = np.random.default_rng(seed)
    V = lm.cfg.vocab_size
    first = g.integers(0, V, 50).tolist()
    second = first[:40] + g.integers(0, V, 21).tolist()
    cache = PrefixCache(make_prefix_pool(lm, 1 << 20, 16))
    kv = lm.new_cache(2)
    lm.prefill(kv, 0, [g.integers(0, V, 30).tolist(), first], last=True)
    assert cache.insert(kv, 1, first) == 4  # 3 whole blocks and the 2 rows of a fourth
    blocks, n = cache.match(second)
    assert n == 40 and len(blocks) == 3  # 40 shared tokens: 2 whole blocks, 8 rows of one
    kv2 = lm.new_cache(3)
    lm.prefill(kv2, 0, [g.integers(0, V, 7).tolist()], last=True)  # slot 0 busy
    assert cache.restore(kv2, 2, blocks, n) == 40 and kv2.used[2] == 40
    cache.release(blocks)
    got = prefill_rest(lm, kv2, 2, second[40:])
    ref_kv = lm.new_cache(1)
    whole = lm.prefill(ref_kv, 0, [second]).logits[0]
    want = whole[40:]
    scale = max(1.0, float(np.abs(want).max()))
    worst = float(np.abs(got - want).max()) / scale
    assert worst <= tol, worst
    # the check can fail: another block's rows in place of the second differ (the order alone
    # would not: attention sums over its (key, value) rows, positions already rotated in)
    kv3 = lm.new_cache(1)
    blocks2, _ = cache.match(second)
    cache.restore(kv3, 0, [blocks2[0], blocks2[0]], 32)
    cache.release(blocks2)
    assert float(np.abs(prefill_rest(lm, kv3, 0, second[32:]) - whole[32:]).max()) > 100 * tol
    tok_a = tok_b = int(np.argmax(want[-1]))
    assert int(np.argmax(got[-1])) == tok_a
    for step in range(4):
        la, _ = lm.decode(ref_kv, 1, [tok_a])
        la = la[0].copy()
        lb, _ = lm.decode(kv2, 3, [0, 0, tok_b])
        d = float(np.abs(lb[2] - la).max()) / max(1.0, float(np.abs(la).max()))
        worst = max(worst, d)
        assert d <= tol, (step, d)
        tok_a, tok_b = int(np.argmax(la)), int(np.argmax(lb[2]))
        assert tok_a == tok_b, step
    return worst


def check_batched_rests(lm, tol: float, seed: int = 0) -> float:
    """Three prompts sharing a first block, cached from a fourth, admitted together as the
    engine admits them (``ModelRunner._prefill_cached``, runners with ``prefills_after_rows``):
    one slot's restored rows are 37 tokens, another's 20 (each ends inside a cached block), a
    third slot empty, and one prefill call feeds each its rest (lengths 5, 19, 11:
    right-padded) after its own past. Each row's
    last logits equal those of prefilling its prompt whole within ``tol`` (relative to the
    largest |logit|), and the three then decode a step together as the plain path does.
    Returns the worst difference."""
    from kvserve.artifact.prefix_pool import make_prefix_pool
    from kvserve.server.prefix_cache import PrefixCache

    assert lm.prefills_after_rows
    g = np.random.default_rng(seed)
    V = lm.cfg.vocab_size
    head = g.integers(0, V, 40).tolist()
    prompts = [head[:37] + g.integers(0, V, 5).tolist(),  # 2 whole blocks and 5 rows: 37 + 5
               head[:20] + g.integers(0, V, 19).tolist(),  # 1 block and 4 rows: 20 + 19
               g.integers(0, V, 11).tolist()]  # nothing cached: 0 + 11
    cache = PrefixCache(make_prefix_pool(lm, 1 << 20, 16))
    kv = lm.new_cache(1)
    lm.prefill(kv, 0, [head + [1]], last=True)
    cache.insert(kv, 0, head + [1])
    kv2 = lm.new_cache(4)
    lm.prefill(kv2, 0, [g.integers(0, V, 9).tolist()], last=True)  # slot 0 busy
    starts = []
    for b, p in enumerate(prompts):
        blocks, n = cache.match(p)
        if n:
            cache.restore(kv2, 1 + b, blocks, n)
        cache.release(blocks)
        starts.append(n)
    assert starts == [37, 20, 0]
    got = lm.prefill(kv2, 1, [p[n:] for p, n in zip(prompts, starts)], last=True).logits
    got = [x[-1].copy() for x in got]
    worst = 0.0
    for p, row in zip(prompts, got):
        want = lm.prefill(lm.new_cache(1), 0, [p], last=True).logits[0][-1]
        worst = max(worst, float(np.abs(row - want).max()) / max(1.0, float(np.abs(want).max())))
        assert int(np.argmax(row)) == int(np.argmax(want))
    assert worst <= tol, worst
    toks = [int(np.argmax(x)) for x in got]
    step, _ = lm.decode(kv2, 4, [0, *toks])
    for b, (p, tok) in enumerate(zip(prompts, toks)):
        want = plain_logits(lm, p, [tok])[0]
        d = float(np.abs(step[1 + b] - want).max()) / max(1.0, float(np.abs(want).max()))
        worst = max(worst, d)
        assert d <= tol, (b, d)
    return worst


def _burst_runs(lm, prefix_mb: int, bursts: list, n_tokens: int) -> list:
    """Each burst's requests submitted together (greedy, speculation off) to one engine with
    the prefix cache on (``prefix_mb``) or off: per burst, each request's events."""
    from kvserve.model.sampling import SamplingParams
    from kvserve.server.detok import TokenBytes
    from kvserve.server.domain import GenerateRequest, OutputParams, StopParams
    from kvserve.server.engine import Engine

    V = lm.cfg.vocab_size
    e = Engine(lm, TokenBytes.without_text(V), max_batch=4, max_queue=8,
               score_chunk_floats=64 * V, eos_id=None, prefix_cache_bytes=prefix_mb << 20,
               speculative_tokens=0)
    e.start()
    try:
        return [[list(h) for h in e.submit_many([GenerateRequest(
            p, SamplingParams(), StopParams(max_new_tokens=n_tokens, ignore_eos=True),
            OutputParams()) for p in prompts])] for prompts in bursts]
    finally:
        e.stop()


def _tokens_and_cached(runs) -> tuple[list, list]:
    from kvserve.server.domain import FinishEvent, TokenEvent

    tokens = [[[ev.token_id for ev in r if isinstance(ev, TokenEvent)] for r in b]
              for b in runs]
    finishes = [[next(ev for ev in r if isinstance(ev, FinishEvent)) for r in b] for b in runs]
    assert all(f.error == "" for b in finishes for f in b), finishes
    return tokens, [[f.cached_tokens for f in b] for b in finishes]


def check_cached_burst(lm, n_tokens: int = 8) -> list[int]:
    """An engine with the prefix cache on (speculation off) and one with it off, each given two
    bursts of four requests sharing a 40-token prefix (the first burst computes it, the second
    finds it cached): the same greedy tokens. Returns the cached prompt tokens of the second
    burst (on)."""
    g = np.random.default_rng(5)
    V = lm.cfg.vocab_size
    head = g.integers(0, V, 40).tolist()
    bursts = [[head + g.integers(0, V, int(k)).tolist() for k in g.integers(1, 12, 4)]
              for _ in range(2)]
    on, cached = _tokens_and_cached(_burst_runs(lm, 16, bursts, n_tokens))
    off, _ = _tokens_and_cached(_burst_runs(lm, 0, bursts, n_tokens))
    assert on == off
    return cached[1]


def check_burst_at_the_context_end(lm) -> None:
    """Two requests admitted together after cached prefixes, one a few tokens short of the
    context's end: padded to the other's longer rest in one call, its row would pass the
    context (learned and sinusoidal position tables have no row there), so they go a slot at a
    time: the tokens of the cache off, no error."""
    g = np.random.default_rng(6)
    V, C = lm.cfg.vocab_size, lm.cfg.max_seq_len
    head = g.integers(0, V, C - 8).tolist()  # its whole blocks cached by the first burst
    cached = (C - 9) // 16 * 16
    later = [head[:cached] + g.integers(0, V, 6).tolist(),  # rest 6 (+ 4 new: inside C)
             head[:16] + g.integers(0, V, 18).tolist()]  # rest 18: padding to it passes C
    assert cached + 6 + 4 <= C < cached + 18  # (and 12 tokens of padding: one group)
    bursts = [[head], [[7] * 20], later]  # (the second leaves slot 0 without head's rows)
    on, cached_on = _tokens_and_cached(_burst_runs(lm, 16, bursts, 4))
    off, _ = _tokens_and_cached(_burst_runs(lm, 0, bursts, 4))
    assert on == off
    assert cached_on[2] == [cached, 16]

"""Requests admitted together whose prompts have cached prefixes: which of them are prefilled
in one call (``prefix_cache.prefill_now``), and the engine doing it on the tiny fused artifact:
one model call for a burst on a shared prefix, outputs and logits those of the cache off."""
from __future__ import annotations

import numpy as np
from test_speedups import LOGIT_TOL, _engine, lm  # noqa: F401  (lm: the module's fixture)

from kvserve.model.sampling import SamplingParams
from kvserve.server.domain import FinishEvent, GenerateRequest, OutputParams, StopParams, \
    TokenEvent
from kvserve.server.engine import Engine
from kvserve.server.prefix_cache import prefill_now

BT = 16
HEAD = [(5 * i) % 200 + 7 for i in range(40)]  # 40 tokens: two whole blocks and 8


def test_the_first_never_waits_and_distinct_prompts_go_together():
    a, b, c = [1] * 20, [2] * 30, [3] * 5
    assert prefill_now([a, b, c], [0, 0, 0], BT) == [True, True, True]
    assert prefill_now([a], [16], BT) == [True]


def test_an_uncached_shared_prefix_waits_for_the_one_that_computes_it():
    ps = [HEAD + [1], HEAD + [2, 3], HEAD[:20] + [4]]
    # the second shares 2 uncached blocks with the first; the third one block
    assert prefill_now(ps, [0, 0, 0], BT) == [True, False, False]
    # once the first's rows are in, the rest go together: they share no more than is cached
    assert prefill_now(ps[1:], [32, 16], BT) == [True, True]


def test_a_shared_prefix_already_cached_costs_no_round():
    ps = [HEAD + [1], HEAD + [2, 3], HEAD + [9] * 30]
    assert prefill_now(ps, [32, 32, 32], BT) == [True, True, True]
    # but a longer shared part than what is cached still waits (a third block in common)
    ps = [HEAD + [1] * 10, HEAD + [1] * 10 + [2]]
    assert prefill_now(ps, [32, 32], BT) == [True, False]


def test_a_match_leaves_one_token_so_identical_short_prompts_share_what_is_computable():
    p = list(range(32))  # two whole blocks; a match covers at most one (one token left)
    assert prefill_now([p, list(p)], [0, 0], BT) == [True, False]
    assert prefill_now([p, list(p)], [16, 16], BT) == [True, True]
    short = list(range(16))  # one block, all of it: no whole block can be restored
    assert prefill_now([short, list(short)], [0, 0], BT) == [True, True]


def _burst(engine: Engine, prompts, n: int = 6) -> tuple[list[list[int]], list, list[int]]:
    """The prompts submitted together: each one's tokens, first-token logits, cached tokens."""
    reqs = [GenerateRequest(list(p), SamplingParams(), StopParams(max_new_tokens=n,
                                                                  ignore_eos=True),
                            OutputParams(return_logits=True)) for p in prompts]
    runs = [list(h) for h in engine.submit_many(reqs)]
    events = [[e for e in evs if isinstance(e, TokenEvent)] for evs in runs]
    cached = [next(e for e in evs if isinstance(e, FinishEvent)).cached_tokens for evs in runs]
    return [[e.token_id for e in evs] for evs in events], [evs[0].logits for evs in events], \
        cached


def _calls(monkeypatch, lm) -> list[int]:
    """The rows of every ``prefill`` call the runner makes from now on."""
    rows: list[int] = []
    orig = lm.prefill

    def spy(kv, lo, prompts, *a, **k):
        rows.append(len(prompts))
        return orig(kv, lo, prompts, *a, **k)
    monkeypatch.setattr(lm, "prefill", spy)
    return rows


def _compare(lm, prompts, got) -> None:
    off = _engine(lm, 0, 0)
    try:
        want = _burst(off, prompts)
    finally:
        off.stop()
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= \
            LOGIT_TOL * max(1.0, float(np.abs(np.asarray(b)).max()))


def test_a_burst_on_a_new_shared_prefix_computes_it_once_then_the_rest_in_one_call(
        lm, monkeypatch):
    prompts = [HEAD + [1, 2], HEAD + [3], HEAD + [4, 5, 6, 7], HEAD + [8] * 9]
    e = _engine(lm, 64, 0)
    try:
        rows = _calls(monkeypatch, lm)
        got = _burst(e, prompts)
        monkeypatch.undo()
    finally:
        e.stop()
    # the first prompt alone (it computes the shared blocks), then the other three together,
    # after all 40 shared tokens (the first's third block holds 8 of them)
    assert rows == [1, 3]
    assert got[2] == [0, 40, 40, 40]
    _compare(lm, prompts, got)


def test_a_rest_past_its_share_of_a_shrunken_chunk_goes_on_in_its_own_slot(lm, monkeypatch):
    """The prefill chunk can shrink between grouping and the call (it is sized by the cache's
    rows, which a restore can grow): each row of the call gets its share of the chunk then, and
    a longer rest's tail follows in its own slot, exactly."""
    warm = _engine(lm, 64, 0)
    try:
        _burst(warm, [HEAD[:32] + [1]])  # two whole shared blocks cached ...
        _burst(warm, [[250] * 20])  # ... and slot 0's rows no longer theirs
        # (each parts from the others at token 32: none restores another's third block)
        prompts = [HEAD[:32] + [200 + i] + HEAD[33:] + rest for i, rest in
                   enumerate(([2, 3], list(range(60, 72)), list(range(100, 130))))]
        sched, runner, restored = warm.sched, warm.runner, []
        chunk, restore = sched.prefill_tokens, runner._restore
        monkeypatch.setattr(sched, "prefill_tokens", lambda: 20 if restored else 64)
        monkeypatch.setattr(runner, "_restore", lambda *a: restored.append(1) or restore(*a))
        rows = _calls(monkeypatch, lm)
        got = _burst(warm, prompts)
        monkeypatch.undo()
        assert sched.prefill_tokens == chunk
    finally:
        warm.stop()
    assert got[2] == [32, 32, 32]
    # rests 10 and 20 grouped under 64; then 10 each in the call, the second's last 10 after
    # it; the 38-token rest alone, in chunks of 20
    assert rows == [2, 1, 1, 1]
    _compare(lm, prompts, got)

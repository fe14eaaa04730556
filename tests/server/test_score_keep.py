"""server.score_cache.KeepPolicy: Score's rows are kept for later Scores while they are
taken; after a run of Score sequences that found nothing kept, keeping backs off to one probe
in a few, and a take that finds something turns it on again. Scores are the same either way
(the pool only saves work)."""
from __future__ import annotations

import numpy as np

from kvserve.server.domain import ScoreRequest
from kvserve.server.score_cache import KeepPolicy, ScorePool
from kvserve.server.scoring import score_steps
from test_score_shared import _cache, _ids, _same, _score, lm  # noqa: F401 (fixture)


def test_the_policy_backs_off_and_probes():
    p = KeepPolicy(after=3, every=4)
    kept = []
    for _ in range(12):
        p.taken(False)
        kept.append(p.keep())
    # misses 1, 2 kept; from the 3rd on, one in four (misses 3, 7, 11)
    assert kept == [True, True, True, False, False, False, True, False, False, False, True,
                    False]
    assert p.skipped == 7
    p.taken(True)
    assert p.misses == 0 and p.keep()


def _run(lm, prefix, policy, seqs):  # noqa: F811
    steps = score_steps(lm, ScoreRequest(seqs), cap=512, share=True,
                        pool=ScorePool(prefix, policy=policy))
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def test_one_off_scores_stop_being_kept_until_one_is_taken(lm):  # noqa: F811
    """One-off sequences (a request each): after ``after`` of them the pool stops filling but
    for the probes; a context sent again is kept by a probe, taken by the next request, and
    keeping is on again; every result as scored without the pool (1e-5)."""
    prefix, policy = _cache(lm), KeepPolicy(after=4, every=3)
    blocks = []
    for i in range(10):  # 64 tokens: 4 whole blocks each
        seq = _ids(100 + i, 64)
        _same(_score(lm, ScoreRequest([seq]), 512, False)[0], _run(lm, prefix, policy, [seq]),
              0)
        blocks.append(prefix.cached_blocks)
    grew = np.diff([0, *blocks]) > 0
    assert grew.tolist() == [True] * 4 + [False, False, True, False, False, True]
    assert policy.skipped == 4
    ctx = _ids(200, 64)
    took = []
    for i in range(5):  # the same context with a new last token each time
        _run(lm, prefix, policy, [ctx + [7 + i]])
        took.append(policy.misses == 0)  # (this take found the context kept)
    first = took.index(True)
    assert first <= 3 and all(took[first:])  # taken once a probe kept it; then every time
    prefix.check()

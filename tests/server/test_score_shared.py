"""Score: sequences of one request that begin alike prefill their shared tokens once
(server.scoring.shared_clusters / _score_cluster), with the same numbers as scoring each
sequence alone (torch, 1e-4) and the rows fed counted."""
from __future__ import annotations

import numpy as np
import pytest

from kvserve_testing import ready_channel, running_app
from kvserve.server.domain import ScoreRequest
from kvserve.server.score_cache import ScorePool
from kvserve.server.scoring import score_steps, shared_clusters
from kvserve.server.slot_rows import common_prefix
from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc
from test_score import check_scores


def _ids(seed: int, n: int, vocab: int = 400) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 10) == 3
    assert common_prefix([1, 2, 3], [1, 5, 3], 10) == 1
    assert common_prefix([], [1], 10) == 0
    assert common_prefix([7], [8], 10) == 0


def test_clusters_group_continuations_of_a_context():
    ctx, other = _ids(1, 40), _ids(2, 30)
    seqs = [ctx + [5], other + [9, 9], ctx + [6, 7], _ids(3, 20), ctx, other + [4], ctx + [5]]
    clusters, rest = shared_clusters(seqs, list(range(len(seqs))))
    got = sorted((n, sorted(m)) for n, m in clusters)
    assert got == [(30, [1, 5]), (40, [0, 2, 4, 6])]
    assert rest == [3]


def test_clusters_need_the_shared_minimum():
    a = _ids(4, 15)
    seqs = [a + [1], a + [2], a[:10]]  # 15 shared tokens: under 16
    assert shared_clusters(seqs, [0, 1, 2]) == ([], sorted([0, 1, 2], key=lambda i: seqs[i]))
    assert shared_clusters(seqs, [0, 1], min_shared=15) == ([(15, [0, 1])], [])


def test_clusters_keep_the_larger_saving():
    """A few-shot header shared by three questions of four choices each: one cluster on the
    header (saves 11 x 200 tokens) rather than one per question (3 x 3 x 230)."""
    header = _ids(5, 200)
    seqs = [header + _ids(10 + q, 30) + [c] for q in range(3) for c in range(4)]
    clusters, rest = shared_clusters(seqs, list(range(len(seqs))))
    assert rest == [] and len(clusters) == 1
    assert clusters[0][0] == 200 and sorted(clusters[0][1]) == list(range(12))
    # two questions' choices with little in common beyond one token: one cluster each
    seqs = [_ids(20 + q, 60) + [c] for q in range(2) for c in range(3)]
    clusters, rest = shared_clusters(seqs, list(range(6)))
    assert rest == [] and sorted((n, sorted(m)) for n, m in clusters) == \
        [(60, [0, 1, 2]), (60, [3, 4, 5])]


def _fed(lm):
    """Count the tokens every prefill of ``lm`` feeds (a spy around the real runner)."""
    fed = []
    real = lm.prefill

    def prefill(kv, lo, prompts, *a, **kw):
        fed.append(sum(len(p) for p in prompts))
        return real(kv, lo, prompts, *a, **kw)
    lm.prefill = prefill
    return fed, real


@pytest.fixture(scope="module")
def lm(artifact):
    from kvserve.artifact.loader import load_lm

    return load_lm(artifact.dir, threads=2, attention=False)


def _score(lm, req, cap, share, prefix=None):
    """(the ScoredSequences, tokens fed) of ``req`` through ``score_steps``."""
    fed, real = _fed(lm)
    try:
        steps = score_steps(lm, req, cap=cap, share=share,
                            pool=None if prefix is None else ScorePool(prefix))
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value, sum(fed)
    finally:
        lm.prefill = real


def _same(plain, shared, top):
    for a, b in zip(plain, shared, strict=True):
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
        if top:
            np.testing.assert_allclose(b.top_logprobs, a.top_logprobs, atol=1e-5)


@pytest.mark.parametrize("top", [0, 3])
def test_shared_score_matches_plain(lm, top):
    """The same request with and without sharing, on the served artifact's runner: every
    logprob within 1e-5, the top ones too; the shared tokens fed once."""
    ctx = _ids(6, 70)
    seqs = [ctx + _ids(7, 9), ctx + [11], ctx, _ids(8, 25), ctx + _ids(9, 33), ctx + [11]]
    req = ScoreRequest(seqs, top_logprobs=top)
    (plain, fed_plain), (shared, fed_shared) = _score(lm, req, 512, False), \
        _score(lm, req, 512, True)
    assert fed_plain == sum(map(len, seqs))
    # the context once, then what follows it but the last tokens (their rows predict nothing)
    assert fed_shared == 70 + 8 + 25 + 32
    _same(plain, shared, top)


@pytest.mark.parametrize("cap,rows", [(16, None), (24, 100), (512, 100)])
def test_shared_score_in_chunks_and_few_slots(lm, monkeypatch, cap, rows):
    """Shared tokens and members' own ones longer than a call's logits (``cap``) go in
    chunks; a cluster whose rows would pass ``_CLUSTER_ROWS`` takes its members one slot at
    a time: the numbers of the whole sequences scored alone, 1e-5."""
    from kvserve.server import scoring

    if rows is not None:
        monkeypatch.setattr(scoring, "_CLUSTER_ROWS", rows)
    header = _ids(30, 50)
    seqs = [header + _ids(31 + q, 12 + 7 * q) + [c, c + 1] for q in range(3) for c in (3, 4)]
    seqs += [header + _ids(40, 45), _ids(41, 60), header]
    req = ScoreRequest(seqs, top_logprobs=2)
    (plain, _), (shared, fed) = _score(lm, req, 512, False), _score(lm, req, cap, True)
    _same(plain, shared, 2)
    own = sum(len(s) - 51 for s in seqs if s[:50] == header and len(s) > 51)
    # (the stranger in one call whole, or in chunks but its last token)
    assert fed == 50 + own + (60 if cap >= 60 else 59)


def test_shared_score_over_grpc_vs_torch(stub, artifact):
    """Over gRPC (the session's server, prefix cache on): two contexts with continuations,
    one a bare context, duplicates and a stranger, top logprobs: torch's numbers (1e-4)."""
    a, b = _ids(12, 48), _ids(13, 20)
    seqs = [a + [40, 41], b + [7], a, a + _ids(14, 30), b + [7], _ids(15, 12), b + [8, 9, 10]]
    resp = stub.Score(pb.ScoreRequest(token_ids=[pb.TokenIds(ids=s) for s in seqs],
                                      top_logprobs=2))
    check_scores(resp, artifact, seqs, top_n=2)


def test_no_sharing_with_the_prefix_cache_off(artifact):
    """``--prefix-cache-mb 0`` turns row sharing off, Score's too: every token is fed."""
    with running_app(artifact, prefix_cache_mb=0) as app:
        assert not app.engine.score_shares
        ctx = _ids(16, 40)
        seqs = [ctx + [1], ctx + [2, 3]]
        fed, real = _fed(app.engine.lm)
        try:
            with ready_channel(app.port) as ch:
                resp = pb_grpc.InferenceStub(ch).Score(
                    pb.ScoreRequest(token_ids=[pb.TokenIds(ids=s) for s in seqs]))
        finally:
            app.engine.lm.prefill = real
        check_scores(resp, artifact, seqs)
        assert sum(fed) >= 41 + 42


# --- across requests: rows and log-probabilities kept in the prefix cache (server.score_cache)
def _cache(lm, mib: float = 8):
    from kvserve.artifact.prefix_pool import make_prefix_pool
    from kvserve.server.prefix_cache import BLOCK_TOKENS, PrefixCache

    return PrefixCache(make_prefix_pool(lm, int(mib * (1 << 20)), BLOCK_TOKENS))


def _pooled(lm, prefix, seqs, top=0, cap=512):
    """(ScoredSequences, tokens fed) of one request scored with ``prefix``."""
    return _score(lm, ScoreRequest(seqs, top_logprobs=top), cap, True, prefix)


@pytest.mark.parametrize("cap", [512, 24])
def test_later_requests_take_a_kept_context(lm, cap):
    """One request a sequence (lm-evaluation-harness's batch size 1): a context of 70 tokens
    with four continuations; after the first, each takes the context's kept whole blocks (64
    tokens) and feeds from the last of them; numbers as scored alone (1e-5), top ones too."""
    prefix = _cache(lm)
    ctx = _ids(50, 70)
    conts = [_ids(51, 5), [9], _ids(52, 40), _ids(53, 2)]
    fed = []
    for c in conts:
        seqs = [ctx + c]
        got, n = _pooled(lm, prefix, seqs, top=2, cap=cap)
        plain, _ = _score(lm, ScoreRequest(seqs, top_logprobs=2), 512, False)
        _same(plain, got, 2)
        fed.append(n)
    T = [70 + len(c) for c in conts]
    assert fed[0] >= T[0] - 1
    assert fed[1:] == [t - 63 - (1 if t - 1 > cap else 0) for t in T[1:]]
    prefix.check()


def test_kept_scores_need_enough_top_tokens(lm):
    """A request asking for more top tokens than were kept computes them (and keeps its
    own, at most ``KEPT_TOP``); fewer are served from the kept ones. A sequence wholly kept
    feeds nothing."""
    prefix = _cache(lm)
    seq = _ids(60, 48)  # three whole blocks
    _, fed = _pooled(lm, prefix, [seq], top=1)
    assert fed == 48
    # (more than KEPT_TOP top tokens: kept are 20, so each such request computes its own)
    for top, want in ((3, 48), (2, 0), (0, 0), (3, 0), (25, 48), (25, 48), (20, 0)):
        got, fed = _pooled(lm, prefix, [seq], top=top)
        plain, _ = _score(lm, ScoreRequest([seq], top_logprobs=top), 512, False)
        _same(plain, got, top)
        assert fed == want, top
        assert got[0].cached_tokens == (48 if want == 0 else 0)


def test_a_cluster_takes_and_keeps_its_shared_tokens(lm):
    """A request of several continuations keeps its shared context; the next request's
    cluster on the same context takes it, and so does a lone sequence."""
    prefix = _cache(lm)
    ctx = _ids(70, 80)
    first = [ctx + _ids(71 + i, 3) for i in range(3)]
    _, fed = _pooled(lm, prefix, first)
    assert fed == 80 + 3 * 2
    second = [ctx + _ids(75 + i, 4) for i in range(3)]
    third = [ctx[:50] + _ids(79, 6)]
    for seqs, want in ((second, 1 + 3 * 3), (third, 56 - 47)):
        got, fed = _pooled(lm, prefix, seqs, top=0)
        plain, _ = _score(lm, ScoreRequest(seqs), 512, False)
        _same(plain, got, 0)
        # the context's 5 blocks: its last token fed again; then 3 blocks (48 tokens) of it
        assert fed == want


def test_a_small_pool_evicts_and_stays_right(lm):
    """A pool of a few blocks under many requests: blocks evicted, none referenced after,
    every number as scored alone."""
    prefix = _cache(lm, mib=0.05)
    assert 0 < prefix.pool.n_blocks < 12
    g = np.random.default_rng(80)
    ctxs = [_ids(81 + i, 40) for i in range(3)]
    for r in range(12):
        seqs = [ctxs[int(g.integers(3))] + _ids(100 + r * 4 + j, int(g.integers(1, 30)))
                for j in range(int(g.integers(1, 4)))]
        top = int(g.integers(0, 3))
        got, _ = _pooled(lm, prefix, seqs, top=top)
        plain, _ = _score(lm, ScoreRequest(seqs, top_logprobs=top), 512, False)
        _same(plain, got, top)
    assert prefix.evictions > 0 and prefix.referenced_blocks == 0
    prefix.check()


def test_score_over_grpc_keeps_its_rows_for_the_next(stub, app, artifact):
    """Two Score calls on one context over gRPC: the second's numbers are torch's (1e-4),
    the context's rows came from the server's prefix cache (its hit counter: the 4 blocks
    but the last token, fed again)."""
    ctx = _ids(90, 64)
    hits = []
    for cont in ([5, 6, 7], [8]):
        seqs = [ctx + cont]
        before = app.metrics.prefix_hits.get()
        resp = stub.Score(pb.ScoreRequest(token_ids=[pb.TokenIds(ids=s) for s in seqs],
                                          top_logprobs=1))
        check_scores(resp, artifact, seqs, top_n=1)
        hits.append(app.metrics.prefix_hits.get() - before)
    assert hits == [0, 63]


def test_a_cluster_clusters_its_members_again_after_the_pool_has_its_rows(lm):
    """A few-shot header before six questions of three choices: one cluster on the header,
    then each question's choices a cluster of their own, which takes the header from the
    pool (its whole blocks: 64 tokens, the last fed again) and computes the question once;
    without the pool each choice computes its question. Numbers as scored alone (1e-5)."""
    header = _ids(110, 64)
    seqs = [header + _ids(111 + q, 20) + [c, c + 1] for q in range(6) for c in (3, 4, 5)]
    plain, _ = _score(lm, ScoreRequest(seqs, top_logprobs=2), 512, False)
    got, fed = _pooled(lm, _cache(lm), seqs, top=2)
    _same(plain, got, 2)
    assert fed == 64 + 6 * ((84 - 63) + 3)
    got, fed = _score(lm, ScoreRequest(seqs, top_logprobs=2), 512, True)  # (no pool)
    _same(plain, got, 2)
    assert fed == 64 + 18 * 21


def test_a_take_counts_once_however_many_share_it(lm):
    """The hit counter hears of a cluster's restored rows once, not once a member; a wholly
    kept sequence counts its tokens (none computed)."""
    prefix, hits = _cache(lm), []
    ctx = _ids(120, 64)
    _pooled(lm, prefix, [ctx + [5]])
    req = ScoreRequest([ctx + [6, 7], ctx + [8], ctx + [9, 10, 11]])
    steps = score_steps(lm, req, cap=512, share=True, pool=ScorePool(prefix, hits.append))
    while True:
        try:
            next(steps)
        except StopIteration as done:
            got = done.value
            break
    assert hits == [63] and [g.cached_tokens for g in got] == [63, 63, 63]
    hits.clear()
    steps = score_steps(lm, ScoreRequest([ctx]), cap=512, share=True,
                        pool=ScorePool(prefix, hits.append))
    for _ in steps:
        pass
    assert hits == [64]


def test_no_member_clusters_where_the_pool_did_not_keep_the_header(lm):
    """A pool too small for the header's blocks: the members are not clustered again (each
    would compute the header again), so no more tokens are fed than with no pool at all."""
    from kvserve.artifact.prefix_pool import block_bytes

    header = _ids(130, 128)
    seqs = [header + _ids(131 + q, 20) + [c, c + 1] for q in range(6) for c in (3, 4, 5)]
    req = ScoreRequest(seqs)
    plain, _ = _score(lm, req, 512, False)
    _, alone = _score(lm, req, 512, True)  # (no pool)
    two = 2 * block_bytes(lm.cfg, 16, 4) / (1 << 20)
    got, fed = _pooled(lm, _cache(lm, mib=two), seqs)
    _same(plain, got, 0)
    assert fed <= alone


def test_a_cluster_cache_stays_under_its_rows(lm):
    """A cluster of 100 members, 16 shared tokens and 2 own each: its private cache holds
    at most ``_CLUSTER_ROWS`` rows for the members (as the cache rounds a slot) and the home
    slot's."""
    from kvserve.artifact.base import chunks
    from kvserve.server import scoring

    ctx = _ids(140, 16)
    seqs = [ctx + _ids(141 + i, 2) for i in range(100)]
    made, real = [], lm.new_cache

    def new_cache(n, capacity):
        made.append((n, capacity))
        return real(n, capacity=capacity)
    lm.new_cache = new_cache
    try:
        got, _ = _score(lm, ScoreRequest(seqs), 512, True)
    finally:
        lm.new_cache = real
    plain, _ = _score(lm, ScoreRequest(seqs), 512, False)
    _same(plain, got, 0)
    assert made and all((n - 1) * chunks(c) <= scoring._CLUSTER_ROWS for n, c in made)


def test_top_logprobs_past_the_vocabulary_lists_it_all(lm):
    V = lm.cfg.vocab_size
    got, _ = _score(lm, ScoreRequest([_ids(150, 20)], top_logprobs=V + 5), 512, True)
    assert got[0].top_logprobs.shape == (19, V) and len(set(got[0].top_ids[0])) == V

"""The n-gram proposer (``kvserve.server.ngram``): exact proposals, the incremental index equal
to a rescan on random sequences, its per-call cost at 4k tokens (printed, not asserted: the
machine is shared), and the adaptive draft length."""
from __future__ import annotations

import random
import time

import pytest

from kvserve.server.ngram import MAX_K, AdaptiveK, NgramIndex, best_k, propose


@pytest.mark.parametrize("tokens,k,want", [
    # the last 2 tokens (3, 4) occurred at 2..3; what followed: 5 6 7
    ([1, 2, 3, 4, 5, 6, 7, 3, 4], 3, [5, 6, 7]),
    ([1, 2, 3, 4, 5, 6, 7, 3, 4], 8, [5, 6, 7, 3, 4, 5, 6, 7]),  # runs on through the copy
    # the most recent earlier occurrence wins: (1, 2) at 0 -> 9, at 3 -> 8
    ([1, 2, 9, 1, 2, 8, 0, 1, 2], 1, [8]),
    # the longest n wins: 4-gram (5, 1, 2, 3) -> 7, although (2, 3) -> 6 is more recent
    ([5, 1, 2, 3, 7, 0, 2, 3, 6, 4, 5, 1, 2, 3], 2, [7, 0]),
    # a loop of period 3: the draft continues the loop past the end
    ([7, 8, 9, 7, 8, 9, 7, 8], 5, [9, 7, 8, 9, 7]),
    # a loop of period 1
    ([4, 4, 4], 4, [4, 4, 4, 4]),
    ([1, 2, 3, 4], 3, []),  # no earlier occurrence
    ([3], 3, []),
    ([], 3, []),
    ([1, 2, 1, 2], 0, []),
])
def test_exact_proposals(tokens, k, want):
    assert NgramIndex(tokens).propose(k) == want
    assert propose(tokens, k) == want


def test_min_n_one_matches_a_single_token():
    assert NgramIndex([5, 6, 7, 5], min_n=1).propose(2) == [6, 7]
    assert NgramIndex([5, 6, 7, 5], min_n=2).propose(2) == []


def test_the_draft_is_capped():
    assert len(NgramIndex([1] * 50).propose(1000)) == MAX_K


def test_bad_n_range_is_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(min_n=0)


def test_incremental_index_equals_a_rescan():
    """Random low-entropy sequences (many repeats), the index fed token by token: after every
    token its proposal equals the scan's, for several (min_n, max_n, k)."""
    rnd = random.Random(5)
    checked = matched = 0
    for trial in range(60):
        vocab = rnd.choice([3, 5, 20])
        min_n = rnd.choice([1, 2])
        max_n = min_n + rnd.choice([0, 1, 3])
        idx = NgramIndex(min_n=min_n, max_n=max_n)
        seq: list[int] = []
        for _ in range(120):
            tok = rnd.randrange(vocab)
            seq.append(tok)
            idx.append(tok)
            k = rnd.choice([1, 3, 7])
            got = idx.propose(k)
            assert got == propose(seq, k, min_n, max_n), (trial, seq, k)
            checked += 1
            matched += bool(got)
    assert checked == 7200 and matched > 3000  # the sequences did repeat


def test_per_call_cost_at_4k_tokens():
    """The cost the engine pays per sequence per step at a 4,096-token context: one append
    and one propose (printed; timing is never asserted on a shared machine)."""
    rnd = random.Random(1)
    base = [rnd.randrange(500) for _ in range(200)]
    toks = [t if rnd.random() < 0.9 else rnd.randrange(500)
            for _ in range(21) for t in base][:4096]  # code-like: repeats with edits
    t0 = time.perf_counter()
    idx = NgramIndex(toks)
    build = time.perf_counter() - t0
    extra = [rnd.randrange(500) for _ in range(2000)]
    t0 = time.perf_counter()
    for tok in extra:
        idx.append(tok)
        idx.propose(8)
    per = (time.perf_counter() - t0) / len(extra)
    print(f"index of 4096 tokens built in {build * 1e3:.2f} ms; "
          f"append + propose(8) {per * 1e6:.1f} us per step at {len(idx)} tokens")
    assert len(idx) == 4096 + 2000


def test_adaptive_k_follows_acceptance():
    cheap = lambda positions: 1.0 + 0.05 * (positions - 1)  # noqa: E731
    a = AdaptiveK(8, probe_every=4)
    first = a.k(cost=cheap)
    assert 1 <= first <= 8
    for _ in range(12):  # drafts that fail: shorter, then off ...
        a.update(max(1, a.k(cost=cheap)), 0)
    ks = [a.k(cost=cheap) for _ in range(4)]
    assert ks[0] == 0 and 1 in ks  # ... until the failures fade (a draft costs little here)
    a.update(1, 1)  # the probe was accepted: back on, growing with the acceptance
    ks = []
    for _ in range(10):
        k = a.k(cost=cheap)
        ks.append(k)
        a.update(k, k)
    assert ks[0] >= 1 and ks[-1] == 8 and ks == sorted(ks)
    assert a.k(cap=0) == 0 and a.k(cap=2, cost=cheap) == 2  # the room left
    assert AdaptiveK(0).k() == 0
    with pytest.raises(ValueError, match="speculative tokens"):
        AdaptiveK(MAX_K + 1)


@pytest.mark.parametrize("a", [0.05, 0.3, 0.6, 0.9, 0.99])
@pytest.mark.parametrize("per", [0.02, 0.1, 0.5, 2.0])
def test_best_k_maximises_expected_tokens_per_cost(a, per):
    cost = lambda positions: 1.0 + per * (positions - 1)  # noqa: E731
    value = [sum(a ** i for i in range(k + 1)) / cost(k + 1) for k in range(9)]
    k = best_k(a, 8, cost)
    assert value[k] == pytest.approx(max(value), rel=1e-9)
    assert k == min(i for i, v in enumerate(value) if v >= max(value) * (1 - 1e-9))


def test_drafting_stops_where_a_draft_cannot_pay_for_itself():
    dear = lambda positions: 1.0 + 1.5 * (positions - 1)  # noqa: E731
    a = AdaptiveK(8, probe_every=4)
    for _ in range(6):  # drafts of 2, half of each accepted
        a.update(2, 1)
    assert a.rate < 0.6
    assert [a.k(cost=dear) for _ in range(4)] == [0, 0, 0, 1]  # a probe keeps it measured
    assert a.k(cost=lambda positions: 1.0) == 8  # free positions: the longest draft

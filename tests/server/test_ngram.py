"""The n-gram proposer (``kvserve.server.ngram``): exact proposals, the incremental index equal
to a rescan on random sequences, its per-call cost at 4k tokens (printed, not asserted: the
machine is shared), and the adaptive draft length."""
from __future__ import annotations

import random
import time

import pytest

from kvserve.server.ngram import (LENGTHS, MAX_K, AdaptiveK, NgramIndex, best_positions,
                                   expected, propose)


@pytest.mark.parametrize("tokens,k,want", [
    # the last 2 tokens (3, 4) occurred at 2..3; what followed: 5 6 7
    ([1, 2, 3, 4, 5, 6, 7, 3, 4], 3, [5, 6, 7]),
    ([1, 2, 3, 4, 5, 6, 7, 3, 4], 8, [5, 6, 7, 3, 4, 5, 6, 7]),  # runs on through the copy
    # the most recent earlier occurrence wins: (1, 2) at 0 -> 9, at 3 -> 8
    ([1, 2, 9, 1, 2, 8, 0, 1, 2], 1, [8]),
    # the longest n wins: the 3-gram (1, 2, 3) -> 7, although (2, 3) -> 6 is more recent
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


def test_a_length_of_one_matches_a_single_token():
    assert NgramIndex([5, 6, 7, 5], lengths=(1, 2)).propose(2) == [6, 7]
    assert NgramIndex([5, 6, 7, 5], lengths=(2, 3)).propose(2) == []


def test_only_the_lengths_asked_for_are_matched():
    """A 5-token repeat is matched at 3 when the lengths are 1, 2, 3 and 8 (the default), and
    its draft is the most recent 3-gram's continuation; with 5 among them, the 5-gram's."""
    seq = [1, 2, 3, 4, 5, 60, 9, 3, 4, 5, 70, 1, 2, 3, 4, 5]
    assert LENGTHS == (1, 2, 3, 8)
    idx = NgramIndex(seq)
    assert idx.propose(1) == [70] and idx.matched == 3
    five = NgramIndex(seq, lengths=(1, 5))
    assert five.propose(1) == [60] and five.matched == 5
    assert propose(seq, 1) == [70] and propose(seq, 1, (1, 5)) == [60]


def test_the_draft_is_capped():
    assert len(NgramIndex([1] * 50).propose(1000)) == MAX_K


def test_bad_lengths_are_refused():
    for bad in ((), (0, 2), (3, 65)):
        with pytest.raises(ValueError, match="lengths"):
            NgramIndex(lengths=bad)


def test_incremental_index_equals_a_rescan():
    """Random low-entropy sequences (many repeats), the index fed token by token: after every
    token its proposal equals the scan's, for several sets of lengths and k."""
    rnd = random.Random(5)
    checked = matched = 0
    for trial in range(60):
        vocab = rnd.choice([3, 5, 20])
        lengths = rnd.choice([(1,), (2,), (1, 2), (1, 2, 3, 4), (2, 5), LENGTHS])
        idx = NgramIndex(lengths=lengths)
        seq: list[int] = []
        for _ in range(120):
            tok = rnd.randrange(vocab)
            seq.append(tok)
            idx.append(tok)
            k = rnd.choice([1, 3, 7])
            got = idx.propose(k)
            assert got == propose(seq, k, lengths), (trial, seq, k)
            checked += 1
            matched += bool(got)
    assert checked == 7200 and matched > 3000  # the sequences did repeat


def _key(gram: list[int]) -> int:
    """An n-gram's key as the index defines it: a polynomial hash mod 2^64 of its tokens,
    built from its last token backwards."""
    h = 0
    for tok in reversed(gram):
        h = (h * 0x9E3779B97F4A7C15 ^ tok) % 2**64
    return h


def test_bulk_extend_equals_token_by_token():
    """``extend`` by chunks of any size (a prompt, then the tokens of a verification) gives
    the index that appending one token at a time gives: every proposal the same."""
    rnd = random.Random(11)
    for trial in range(40):
        vocab = rnd.choice([2, 4, 30, 262_144])  # (large ids: the keys wrap mod 2^64)
        lengths = rnd.choice([(1,), (3,), (1, 2, 3), (3, 4, 5), (2, 6), LENGTHS])
        bulk, seq = NgramIndex(lengths=lengths), []
        while len(seq) < 300:
            chunk = [rnd.randrange(vocab) for _ in range(rnd.choice([0, 1, 2, 3, 9, 40]))]
            bulk.extend(chunk)
            seq += chunk
            # the definition: per n, each n-gram (by its key) -> the end of its latest
            # occurrence that has a follower
            assert [bulk._table[n] for n in lengths] == \
                [{_key(seq[e - n:e]): e for e in range(n, len(seq))} for n in lengths], trial
            for k in (1, 4, 9):
                assert bulk.propose(k) == propose(seq, k, lengths)


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


def test_the_acceptance_estimate_follows_the_verifications():
    a = AdaptiveK(8)
    assert a.rate(4, 0.6) == pytest.approx(0.6) and a.k() == 8 and a.k(cap=3) == 3
    assert a.k(cap=0) == 0
    for _ in range(10):  # drafts of 4 after a 4-token match, all accepted
        a.update(4, 4, 4)
    assert a.rate(4, 0.6) > 0.95
    assert a.rate(1, 0.3) == pytest.approx(0.3)  # another match length: the prior alone
    for _ in range(20):  # drafts of 4, the first token rejected each time
        a.update(4, 4, 0)
    # its own ~5 decayed trials (nearly all misses) against the prior's 2: ~(2 * 0.6) / 7
    assert 1.2 / 7 < a.rate(4, 0.6) < 0.2
    assert a.rate(4, 0.0) < 0.05
    for _ in range(40):  # drafts not used: back towards the prior
        a.fade()
    assert a.rate(4, 0.6) == pytest.approx(0.6, abs=0.05)
    assert AdaptiveK(0).k() == 0
    with pytest.raises(ValueError, match="speculative tokens"):
        AdaptiveK(MAX_K + 1)


def test_a_proposal_says_how_long_a_match_it_follows():
    idx = NgramIndex([1, 2, 3, 4, 5, 9, 9, 3, 4, 5])
    assert idx.propose(2) == [9, 9] and idx.matched == 3  # (3, 4, 5) seen before
    idx.append(7)
    assert idx.propose(2) == [] and idx.matched == 0  # 7 never seen
    assert NgramIndex([1, 2] * 10).propose(3) == [1, 2, 1]
    assert NgramIndex([1, 2] * 10).matched == 0  # (before any proposal)
    loop = NgramIndex([1, 2] * 10)
    loop.propose(3)
    assert loop.matched == LENGTHS[-1]  # a loop matches the longest n looked up


def test_expected_tokens_of_a_draft():
    assert expected(0.5, 3) == pytest.approx([1, 1.5, 1.75, 1.875])
    assert expected(0.0, 2) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("a", [0.05, 0.3, 0.6, 0.9, 0.99])
@pytest.mark.parametrize("per", [0.02, 0.1, 0.5, 2.0])
def test_one_row_takes_the_length_with_most_expected_tokens_per_cost(a, per):
    cost = lambda positions: 1.0 + per * (positions - 1)  # noqa: E731
    value = [sum(a ** i for i in range(k + 1)) / cost(k + 1) for k in range(9)]
    k = best_positions([(a, 8)], cost) - 1
    assert best_positions([(a, 8)], [cost(S) for S in range(1, 10)]) == k + 1  # (a sequence)
    assert value[k] == pytest.approx(max(value), rel=1e-9)
    assert k == min(i for i, v in enumerate(value) if v >= max(value) * (1 - 1e-9))


def test_a_row_without_a_draft_is_not_slowed_for_the_others_sake():
    """Two rows in a loop and six without a draft, where 8 extra positions double the call: the
    batch's tokens per cost peak at S = 9 (15.2 + 6 tokens for 2x the time), which runs the six
    at half their speed; the rows' geometric-mean speed peaks at S = 2 (each of the six at
    1 / 1.125, the two at 1.95 / 1.125)."""
    cost = lambda positions: 1.0 + 0.125 * (positions - 1)  # noqa: E731
    rows = [(0.95, 8)] * 2 + [(0.0, 0)] * 6
    tokens = [sum(expected(a, k)[min(S - 1, k)] for a, k in rows) / cost(S) for S in range(1, 10)]
    assert max(range(9), key=tokens.__getitem__) + 1 == 9  # (what the sum of tokens would take)
    assert best_positions(rows, cost) == 2
    assert best_positions([(0.95, 8)] * 6 + [(0.0, 0)] * 2, cost) == 9  # most rows gain: long


def test_a_batch_weighs_every_row_against_the_padding():
    """Batch 8 where 8 extra positions a row double the call: one good row's long draft does
    not pay for the other rows' padding; eight good rows' drafts do."""
    cost = lambda positions: 1.0 + 0.125 * (positions - 1)  # noqa: E731
    one = [(0.9, 8)] + [(0.0, 0)] * 7
    assert best_positions(one, cost) == 1  # 7 + 6.1 tokens for 2x the time: plain is better
    assert best_positions([(0.9, 8)] * 8, cost) == 9  # 48.8 tokens for 2x the time
    assert best_positions([(0.9, 2)] * 7 + [(0.9, 8)], cost) == 3  # (not padded to the long one)
    assert best_positions([(0.6, 0)] * 4, cost) == 1  # no drafts: plain


"""The pure sampling functions shared by the torch reference and the server."""
from __future__ import annotations

import numpy as np
import pytest

from kvserve.model.sampling import (SamplingParams, apply_penalties, filter_logits,
                                    log_softmax, next_token, position_uniforms, request_seed,
                                    softmax, top_n)

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0], dtype=np.float32)
EMPTY = np.zeros(0, dtype=np.int64)


def kept(x: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(x)).tolist())


def test_greedy_is_argmax():
    assert next_token(LOGITS, SamplingParams(), None, 0, EMPTY, EMPTY) == 5
    assert next_token(LOGITS, SamplingParams(temperature=1e-6), 3, 9, EMPTY, EMPTY) == 5


def test_top_k_keeps_the_k_largest():
    assert kept(filter_logits(LOGITS, SamplingParams(temperature=1.0, top_k=2))) == {0, 5}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p = softmax(LOGITS)  # sorted: 5 (0.61), 0 (0.22), 1 (0.08), ...
    order = np.argsort(-p)
    mass = p[order[0]] + p[order[1]]
    got = kept(filter_logits(LOGITS, SamplingParams(temperature=1.0, top_p=float(mass) - 1e-3)))
    assert got == {int(order[0]), int(order[1])}
    assert kept(filter_logits(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6))) == {5}


def test_min_p_drops_tokens_below_fraction_of_the_best():
    p = softmax(LOGITS)
    got = kept(filter_logits(LOGITS, SamplingParams(temperature=1.0, min_p=0.3)))
    assert got == set(np.flatnonzero(p >= 0.3 * p.max()).tolist())


def test_temperature_scales_logits():
    out = filter_logits(LOGITS, SamplingParams(temperature=0.5))
    assert np.allclose(out, LOGITS * 2)


def test_repetition_penalty_hf_rule():
    out = apply_penalties(LOGITS, np.array([0, 4]), EMPTY, SamplingParams(repetition_penalty=2.0))
    assert out[0] == pytest.approx(1.0) and out[4] == pytest.approx(-2.0)
    assert out[1] == LOGITS[1]


def test_presence_and_frequency_penalties_openai_rule():
    gen = np.array([1, 1, 1, 2])
    out = apply_penalties(LOGITS, gen, gen, SamplingParams(presence_penalty=0.5,
                                                           frequency_penalty=0.25))
    assert out[1] == pytest.approx(1.0 - 0.5 - 0.75)
    assert out[2] == pytest.approx(0.5 - 0.5 - 0.25)
    assert out[0] == LOGITS[0]


def _rule(x: np.ndarray, seed: int, k: int) -> int:
    """The seed rule as model/sampling.py's docstring states it, written out."""
    key = np.array([seed % 2**64, (seed >> 64) % 2**64], np.uint64)
    words = np.random.Philox(key=key, counter=np.array([0, k, 0, 0], np.uint64)).random_raw(
        x.shape[-1])
    u = np.array([int(w) >> 11 for w in words], np.float64) / 2.0**53
    with np.errstate(divide="ignore"):
        return int(np.argmax(np.where(np.isfinite(x), x - np.log(-np.log(u)), -np.inf)))


def test_seeded_sampling_is_reproducible_and_follows_the_rule():
    params = SamplingParams(temperature=0.8, top_k=4, seed=1234)
    a = [next_token(LOGITS, params, 1234, k, EMPTY, EMPTY) for k in range(200)]
    b = [next_token(LOGITS, params, 1234, k, EMPTY, EMPTY) for k in reversed(range(200))][::-1]
    assert a == b  # a position's draw: whatever was drawn before it
    x = filter_logits(LOGITS, params)
    assert a == [_rule(x, 1234, k) for k in range(200)]
    assert len(set(a)) > 1 and set(a) <= {0, 1, 2, 5}  # samples, within top-k
    big = 2**100 + 12345  # seeds past 64 bits use both key words
    assert [next_token(LOGITS, params, big, k, EMPTY, EMPTY) for k in range(50)] == \
        [_rule(x, big, k) for k in range(50)]


def test_positions_and_seeds_never_share_a_stream():
    u0, u1 = position_uniforms(5, 0, 4096), position_uniforms(5, 1, 4096)
    assert not set(u0.tolist()) & set(u1.tolist())
    assert not set(u0.tolist()) & set(position_uniforms(6, 0, 4096).tolist())
    assert request_seed(7) == 7 and request_seed(None) != request_seed(None)


def test_sampling_frequencies_follow_probabilities():
    params = SamplingParams(temperature=1.0)
    want = softmax(LOGITS)
    over_positions = np.bincount([next_token(LOGITS, params, 7, k, EMPTY, EMPTY)
                                  for k in range(20000)], minlength=6)
    over_seeds = np.bincount([next_token(LOGITS, params, s, 3, EMPTY, EMPTY)
                              for s in range(20000)], minlength=6)
    for counts in (over_positions, over_seeds):
        assert np.abs(counts / 20000 - want).max() < 0.015


@pytest.mark.parametrize("V, sd, temperature", [(4096, 1.0, 1.0), (4096, 0.1, 1.0),
                                                (32000, 1.0, 1.0), (32000, 3.0, 0.7)])
def test_a_draw_does_not_move_with_rounding(V, sd, temperature):
    """Logits moved by 1e-6 of their largest (a verification call's rounding is up to 6.5e-7):
    no draw of 500 changes (the inverse-CDF rule this replaced changed 0.05-4.3%)."""
    rng = np.random.default_rng(V + int(10 * sd))
    params = SamplingParams(temperature=temperature)
    for k in range(500):
        x = (rng.standard_normal(V) * sd).astype(np.float32)
        moved = x + (rng.standard_normal(V) * 1e-6 * np.abs(x).max()).astype(np.float32)
        assert next_token(x, params, 99, k, EMPTY, EMPTY) == \
            next_token(moved, params, 99, k, EMPTY, EMPTY), k


def test_log_softmax_and_top_n():
    lp = log_softmax(LOGITS)
    assert np.exp(lp).sum() == pytest.approx(1.0, abs=1e-6)
    ids, vals = top_n(lp, 3)
    assert ids.tolist() == [5, 0, 1]
    assert np.allclose(vals, lp[[5, 0, 1]])


@pytest.mark.parametrize("first", [1024, 16])  # (16: the widening steps and the full order)
def test_top_p_prefix_is_the_whole_orders(first, monkeypatch):
    """top-p keeps the same ids as ordering the whole vocabulary, ties (equal probabilities
    on the boundary) and near-flat distributions included."""
    import kvserve.model.sampling as S

    monkeypatch.setattr(S, "_TOP_P_FIRST", first)

    def whole(probs, top_p):
        order = S.sorted_order(probs)
        cum = np.cumsum(probs[order])
        return order[:int(np.searchsorted(cum, np.float32(top_p), side="left")) + 1]

    rng = np.random.default_rng(0)
    for V in (7, 300, 4096):
        for trial in range(24):
            x = [rng.standard_normal(V) * rng.uniform(0.05, 4),
                 np.round(rng.standard_normal(V) * 3),  # many ties
                 np.where(rng.random(V) < 0.01, 5.0, 0.0),  # flat with peaks
                 rng.standard_normal(V) * 0.01][trial % 4]  # near flat
            probs = softmax(x.astype(np.float32))
            for top_p in (0.05, 0.5, 0.95, 0.9999999):
                np.testing.assert_array_equal(S.top_p_prefix(probs, top_p), whole(probs, top_p))


def test_top_n_breaks_ties_by_id_across_the_cut():
    """Equal logprobs straddling the cut: the lowest ids, whatever n, so a shorter list is
    the head of a longer one."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        lp = np.round(rng.normal(size=300), 1).astype(np.float32)  # many exact ties
        lp[rng.integers(0, 300, 40)] = lp.max()
        longest, vals = top_n(lp, 60)
        assert list(vals) == sorted(vals, reverse=True)
        for n in (1, 5, 20, 59):
            ids, v = top_n(lp, n)
            assert list(ids) == list(longest[:n]) and list(v) == list(vals[:n])
        want = sorted(range(300), key=lambda i: (-lp[i], i))[:60]
        assert list(longest) == want
    assert list(top_n(np.zeros(4, np.float32), 9)[0]) == [0, 1, 2, 3]

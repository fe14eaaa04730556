"""The pure sampling functions shared by the torch reference and the server."""
from __future__ import annotations

import numpy as np
import pytest

from kvserve.model.sampling import (SamplingParams, apply_penalties, draw, filter_logits,
                                    log_softmax, make_rng, next_token, softmax, top_n)

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0], dtype=np.float32)
EMPTY = np.zeros(0, dtype=np.int64)


def kept(x: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(x)).tolist())


def test_greedy_is_argmax_and_draws_nothing():
    rng = make_rng(0)
    state = rng.bit_generator.state
    assert next_token(LOGITS, SamplingParams(), rng, EMPTY, EMPTY) == 5
    assert rng.bit_generator.state == state


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


def test_seeded_sampling_is_reproducible_and_follows_the_rule():
    params = SamplingParams(temperature=0.8, top_k=4, seed=1234)
    a = [next_token(LOGITS, params, r, EMPTY, EMPTY) for r in [make_rng(1234)] for _ in range(50)]
    rng = make_rng(1234)
    b = [next_token(LOGITS, params, rng, EMPTY, EMPTY) for _ in range(50)]
    rng2 = make_rng(1234)
    probs = softmax(filter_logits(LOGITS, params))
    c = [draw(probs, rng2.random()) for _ in range(50)]
    assert b == c
    assert len(set(b)) > 1  # actually samples
    assert set(b) <= {0, 1, 2, 5}
    assert a[0] == b[0]


def test_sampling_frequencies_follow_probabilities():
    rng = make_rng(7)
    params = SamplingParams(temperature=1.0)
    counts = np.bincount([next_token(LOGITS, params, rng, EMPTY, EMPTY) for _ in range(20000)],
                         minlength=6)
    assert np.abs(counts / 20000 - softmax(LOGITS)).max() < 0.015


def test_log_softmax_and_top_n():
    lp = log_softmax(LOGITS)
    assert np.exp(lp).sum() == pytest.approx(1.0, abs=1e-6)
    ids, vals = top_n(lp, 3)
    assert ids.tolist() == [5, 0, 1]
    assert np.allclose(vals, lp[[5, 0, 1]])

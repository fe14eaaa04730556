"""``artifact.rows.LogSoftmax`` (Score's log-probabilities on onnxruntime) against numpy's
``model.sampling.log_softmax``, the reference the sampling code uses."""
from __future__ import annotations

import numpy as np
import pytest

from kvserve.artifact.rows import LogSoftmax
from kvserve.model.sampling import log_softmax

TOL = 1e-5  # float32 log-probabilities of magnitude <= ~40: a few ulps apart (2e-6 measured)


@pytest.fixture(scope="module")
def lsm():
    return LogSoftmax(threads=2)


@pytest.mark.parametrize("shape", [(1, 7), (3, 64), (256, 4096), (5, 50_257)])
def test_matches_numpy(lsm, shape):
    g = np.random.default_rng(sum(shape))
    rows = (g.standard_normal(shape) * 8).astype(np.float32)
    rows[0, 0] = 80.0  # a dominant logit: the max is subtracted first, no overflow
    got = lsm(rows)
    assert got.shape == shape and got.dtype == np.float32
    assert np.abs(got - log_softmax(rows)).max() <= TOL
    assert np.allclose(np.exp(got.astype(np.float64)).sum(-1), 1.0, atol=1e-5)


def test_views_and_other_dtypes(lsm):
    """A strided view (a column slice, every other row) and float16 / float64 rows are taken
    as their float32 values."""
    g = np.random.default_rng(3)
    big = g.standard_normal((10, 200)).astype(np.float64)
    view = big[::2, 50:150]
    assert np.abs(lsm(view) - log_softmax(view.astype(np.float32))).max() <= TOL
    half = g.standard_normal((4, 33)).astype(np.float16)
    assert np.abs(lsm(half) - log_softmax(half.astype(np.float32))).max() <= TOL


def test_runner_log_softmax_is_shared(lm):
    """The runners make the session on first use and keep it."""
    rows = np.random.default_rng(4).standard_normal((2, lm.cfg.vocab_size)).astype(np.float32)
    a = lm.log_softmax(rows)
    first = lm._log_softmax
    assert np.abs(lm.log_softmax(rows) - a).max() == 0 and lm._log_softmax is first
    assert np.abs(a - log_softmax(rows)).max() <= TOL

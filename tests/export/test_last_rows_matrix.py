"""``prefill(last=True)`` (the fused graph's head over each prompt's last row only, through
``logits_rows``) against the all-rows call, for every config and precision of the export
matrix and, where exported, through the attention-diagnostics graph: the last-row indices of a
right-padded batch are right in fp32, fp16, int8 and int4 alike."""
from __future__ import annotations

import numpy as np
import pytest

from export_matrix import CONFIGS, EXPORTS, THREADS

from kvserve.artifact.fused import FusedLM

LENGTHS = (7, 2, 12)
# the head over one row or over all of them: a different matmul shape, so different rounding;
# relative to the largest logit of the batch. int8 quantizes each MatMul's input dynamically
# with one scale per tensor: over all rows of the batch, or over the last rows alone (as a
# decode step does), so its logits move by about one quantization step (0.8% measured)
REL_TOL = {"fp32": 1e-5, "fp16": 2e-3, "int8": 2e-2, "int4": 1e-3}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_last_rows_match_all_rows(store, name):
    precision, attention = EXPORTS[name]
    lm = FusedLM(store.artifact(name), provider="cpu", threads=THREADS, attention=attention)
    assert lm.last_rows
    g = np.random.default_rng(len(name))
    prompts = [g.integers(0, lm.cfg.vocab_size, n).tolist() for n in LENGTHS]
    for attn in ([False, True] if attention else [False]):
        every = lm.prefill(lm.new_cache(3), 0, prompts, attention=attn)
        last = lm.prefill(lm.new_cache(3), 0, prompts, attention=attn, last=True)
        scale = max(float(np.abs(x).max()) for x in every.logits)
        for p, a, b in zip(prompts, every.logits, last.logits):
            assert a.shape == (len(p), lm.cfg.vocab_size) and b.shape == (1, lm.cfg.vocab_size)
            assert np.abs(b[0] - a[-1]).max() <= REL_TOL[precision] * scale, (name, attn)
        if attn:  # the attention rows do not depend on which logits were asked for
            for x, y in zip(every.attention, last.attention):
                assert np.abs(x - y).max() <= 1e-6

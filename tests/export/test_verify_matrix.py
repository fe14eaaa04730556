"""Speculative verification (``FusedLM.verify`` + ``DeviceKV.truncate``) on every config of the
export matrix (GQA, MHA, MQA; rope, learned, sinusoidal and no positions; fp32, fp16, int8,
int4): one call's teacher-forced logits against plain decode steps, batches with different
draft lengths per row, truncation; greedy output through n-gram drafts identical to plain."""
from __future__ import annotations

import pytest
from export_matrix import CONFIGS, EXPORTS, LOGIT_TOL, THREADS
from spec_testing import check_greedy_speculation, check_verify_teacher_forced

from kvserve.artifact.fused import FusedLM

# relative to the largest |logit|: the 1e-4 at every precision. Measured on CPU: at
# most 6.5e-7 (int8 quantizes activations per row, so a K+1-row call rounds as 1-row steps do)
TOL = {"fp32": LOGIT_TOL, "fp16": LOGIT_TOL, "int8": LOGIT_TOL, "int4": LOGIT_TOL}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verify_matches_plain_steps(store, name):
    precision, _ = EXPORTS[name]
    lm = FusedLM(store.artifact(name), provider="cpu", threads=THREADS, attention=False)
    worst = check_verify_teacher_forced(lm, TOL[precision], seed=len(name))
    print(f"{name} ({precision}): max relative |Δlogit| {worst:.2e}")
    check_greedy_speculation(lm, [5, 6, 7, 8, 9] * 4 + [5, 6], 30)

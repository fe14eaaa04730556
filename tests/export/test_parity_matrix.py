"""Parity of every config of the matrix: torch vs onnxruntime on a left-padded batch, prefill
plus 64 teacher-forced decode steps (the gate inside ``export_artifacts``), read back from the
manifest and held to the issue's figures."""
from __future__ import annotations

import json

import pytest

from kvserve.model.config import FFNS, NORMS, PLACEMENTS, POSITIONS

from export_matrix import CONFIGS, EXPORTS, LOGIT_TOL, make_config


def test_matrix_covers_every_option():
    cfgs = [make_config(n) for n in CONFIGS]
    assert {c.positions for c in cfgs} == set(POSITIONS)
    assert {c.norm for c in cfgs} == set(NORMS)
    assert {c.norm_placement for c in cfgs} == set(PLACEMENTS)
    assert {c.final_norm for c in cfgs} == {True, False}
    # geglu_tanh (Gemma) and the other options of imported families are exported and served
    # per family in tests/families
    assert {c.ffn for c in cfgs} == set(FFNS) - {"geglu_tanh"}
    assert {("MHA" if c.n_kv_heads == c.n_heads else "MQA" if c.n_kv_heads == 1 else "GQA")
            for c in cfgs} == {"MHA", "GQA", "MQA"}
    assert {c.tie_embeddings for c in cfgs} == {True, False}
    for bias in ("qkv_bias", "out_bias", "ffn_bias"):
        assert {getattr(c, bias) for c in cfgs} == {True, False}, bias
    # several options change between any two configs
    for a in CONFIGS:
        for b in CONFIGS:
            if a < b:
                diff = {k for k in set(CONFIGS[a]) | set(CONFIGS[b])
                        if CONFIGS[a].get(k) != CONFIGS[b].get(k)}
                assert len(diff) >= 3, (a, b, diff)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_fp32(store, name):
    art = store.artifact(name)  # raises ParityError if the gate fails
    m = json.loads((art / "manifest.json").read_text())
    p = m["parity"]["fp32"]
    assert p["batch"] == 3 and p["decode_steps"] >= 64
    assert p["tolerance"] == pytest.approx(LOGIT_TOL)
    assert 0.0 <= p["max_abs_logit_prefill"] <= LOGIT_TOL
    assert 0.0 <= p["max_abs_logit_decode"] <= LOGIT_TOL
    assert p["greedy_tokens_equal"] is True and p["token_agreement"] == 1.0
    precision, attention = EXPORTS[name]
    assert m["precision"] == precision
    assert set(m["graphs"]) == ({"prefill", "decode", "prefill_attn", "decode_attn"} if attention
                                else {"prefill", "decode"})
    if attention:
        assert p["max_abs_attention"] is not None and p["max_abs_attention"] <= 1e-5

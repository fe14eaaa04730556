"""Parity of every config of the matrix: torch vs onnxruntime on a left-padded batch, prefill
plus 64 teacher-forced decode steps (the gate inside ``export_artifacts``), read back from the
manifest and held to the issue's figures."""
from __future__ import annotations

import json

import pytest

from kvserve.model.config import FFNS, NORMS, PLACEMENTS, POSITIONS

from export_matrix import ATTN_RTOL, CONFIGS, EXPORTS, LOGIT_TOL, make_config


def test_matrix_covers_every_option():
    cfgs = [make_config(n) for n in CONFIGS]
    assert {c.positions for c in cfgs} == set(POSITIONS)
    assert {c.norm for c in cfgs} == set(NORMS)
    assert {c.norm_placement for c in cfgs} == set(PLACEMENTS)
    assert {c.final_norm for c in cfgs} == {True, False}
    # geglu_tanh (Gemma) and the other options of imported families are exported fused in
    # test_fused_options.py, and served per family in tests/families
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
    assert m["kind"] == m["runtime"]["kind"] == "fused"
    assert set(m["graphs"]) == ({"model", "model_attn"} if attention else {"model"})
    if attention:
        assert p["max_abs_attention"] is not None and p["max_abs_attention"] <= 1e-5
        assert 0.0 <= p["max_rel_attention"] <= ATTN_RTOL and p["attention_rtol"] == ATTN_RTOL


def test_parity_portable(store):
    """``--portable``: the standard-ops prefill/decode graphs pass the same gate."""
    art = store.artifact("llama", portable=True)
    m = json.loads((art / "manifest.json").read_text())
    assert m["kind"] == m["runtime"]["kind"] == "portable"
    assert m["runtime"]["kv"]["layout"] == "new_rows"
    assert set(m["graphs"]) == {"prefill", "decode", "prefill_attn", "decode_attn"}
    p = m["parity"]["fp32"]
    assert max(p["max_abs_logit_prefill"], p["max_abs_logit_decode"]) <= LOGIT_TOL
    assert p["greedy_tokens_equal"] is True and p["max_abs_attention"] <= 1e-5
    assert p["max_rel_attention"] <= ATTN_RTOL


def test_head_dim_the_fused_op_cannot_take_falls_back_to_portable(tmp_path, tokenizer_json):
    """head_dim 8 (GroupQueryAttention on CPU needs a multiple of 16): exported portable, the
    manifest says why, and it passes the gate."""
    import torch

    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.checkpoint import save_checkpoint
    from kvserve.model.transformer import Transformer

    torch.manual_seed(3)
    cfg = make_config("gpt2").replace(d_model=32)
    assert cfg.head_dim == 8
    ckpt = save_checkpoint(tmp_path / "ckpt", Transformer(cfg).eval(),
                           tokenizer_json=tokenizer_json)
    art = export_artifacts(ckpt, tmp_path / "art", attention=False, progress=False, threads=1)
    m = json.loads((art / "manifest.json").read_text())
    assert m["kind"] == "portable" and set(m["graphs"]) == {"prefill", "decode"}
    assert any("head_dim 8" in why for why in m["runtime"]["portable_because"])
    p = m["parity"]["fp32"]
    assert max(p["max_abs_logit_prefill"], p["max_abs_logit_decode"]) <= LOGIT_TOL

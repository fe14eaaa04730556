"""The attention part of the parity gate: a bound relative to each probability
(|Δp| <= 5e-4 p + 1e-6) that fp32 meets on larger shapes too, and a failure of the
diagnostics graph alone that says so, with the logits' figures and the flag that exports
without it."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from export_matrix import ATTN_ATOL, ATTN_RTOL, LOGIT_TOL, THREADS

from kvserve import cli
from kvserve.export import parity
from kvserve.export.parity import (AttentionParityError, ParityError, ParityReport,
                                   attention_diff, gate)
from kvserve.export.pipeline import export_artifacts
from kvserve.model.checkpoint import save_checkpoint
from kvserve.model.config import ModelConfig
from kvserve.model.transformer import Transformer


def test_the_bound_is_relative_to_each_probability():
    assert (parity.ATTENTION_RTOL, parity.ATTENTION_ATOL) == (ATTN_RTOL, ATTN_ATOL)
    want = np.array([0.9, 0.09, 0.009, 0.001], np.float32)
    at_bound = want + (ATTN_RTOL * want + ATTN_ATOL) * np.array([1, -1, 1, -1])
    absolute, rel = attention_diff(at_bound.astype(np.float32), want)
    assert absolute == pytest.approx(ATTN_RTOL * 0.9 + ATTN_ATOL, rel=1e-3)  # 4.5e-4 allowed
    assert rel == pytest.approx(ATTN_RTOL, rel=1e-3)
    off = want.copy()
    off[3] += 5e-6  # a small probability off by 5e-6: 5x its bound (1.5e-6)
    assert attention_diff(off, want)[1] > 3 * ATTN_RTOL
    nan = want.copy()
    nan[0] = np.nan
    assert attention_diff(nan, want) == (float("inf"), float("inf"))


def test_attention_alone_failing_says_so_and_names_the_flag():
    ok = ParityReport(2e-5, 3e-5, 64, 3, True, 1.0, 1.6e-5, None, 6e-5)
    gate(ok, LOGIT_TOL)  # the issue's |Δp| 1.63e-5 on a d384 model: within the bound
    assert ok.attention_rtol == ATTN_RTOL
    bad = dataclasses.replace(ok, max_rel_attention=2e-3)
    with pytest.raises(AttentionParityError) as e:
        gate(bad, LOGIT_TOL)
    msg = str(e.value)
    assert "the attention-diagnostics graph only" in msg
    assert "The logits are within tolerance (max |Δlogit| 3e-05 <= 0.0001, greedy tokens " \
           "equal)" in msg
    assert msg.endswith("export without the diagnostics graph with --no-attention")
    # the logits failing too: one ParityError listing both, no claim that the logits are fine
    with pytest.raises(ParityError) as e:
        gate(dataclasses.replace(bad, max_abs_logit_decode=5e-4), LOGIT_TOL)
    assert not isinstance(e.value, AttentionParityError)
    assert "max |Δlogit| 0.0005 > tolerance" in str(e.value) and "attention" in str(e.value)
    assert "within tolerance" not in str(e.value)


def test_cli_attention_only_failure_then_no_attention_exports(main_ckpt, tmp_path, monkeypatch,
                                                              capsys):
    """A real export whose attention bound is made unmeetable (1e-12): it fails, nothing is
    written, and the message says attention only, with the flag; the same command with that
    flag exports."""
    monkeypatch.setattr(parity, "ATTENTION_RTOL", 1e-12)
    out = tmp_path / "art"
    argv = ["export", str(main_ckpt), "--out", str(out), "--threads", str(THREADS)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert re.search(r"kvserve export: FAILED: parity gate failed: the attention-diagnostics "
                     r"graph only: attention max \|Δp\|/\(p \+ \S+\) \S+ > 1e-12 .*The logits "
                     r"are within tolerance \(max \|Δlogit\| \S+ <= 0\.0001, greedy tokens "
                     r"equal\): export without the diagnostics graph with --no-attention; no "
                     r"artifact written", err), err
    assert list(tmp_path.iterdir()) == []
    assert cli.main(argv + ["--no-attention"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert set(m["graphs"]) == {"model"} and m["parity"]["fp32"]["max_abs_attention"] is None


@pytest.mark.slow
def test_a_d384_six_layer_llama_passes_with_its_attention(tmp_path, tokenizer_json):
    """The issue's shape: d384, 6 layers, 6/2 heads, random init at the tests' 0.1 with
    perturbed norm gains. Measured: max |Δp| 1.3e-5 (the old absolute 1e-5 failed the whole
    export), |Δp| / (p + 0.002) 6e-5 against the bound's 5e-4, logits 6e-5."""
    cfg = ModelConfig(vocab_size=300, d_model=384, n_layers=6, n_heads=6, n_kv_heads=2,
                      max_seq_len=512, init_std=0.1)
    torch.manual_seed(2)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, tokenizer_json=tokenizer_json)
    art = export_artifacts(ckpt, tmp_path / "art", attention=True, progress=False,
                           threads=THREADS)
    p = json.loads((art / "manifest.json").read_text())["parity"]["fp32"]
    assert max(p["max_abs_logit_prefill"], p["max_abs_logit_decode"]) <= LOGIT_TOL
    assert p["greedy_tokens_equal"] is True
    assert 0.0 < p["max_rel_attention"] <= ATTN_RTOL
    # in the regime the absolute bound could not hold: 10x the export matrix's deltas
    assert p["max_abs_attention"] > 2e-6

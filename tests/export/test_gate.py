"""The parity gate fails when it should: a changed torch weight or a changed decode graph is
caught with the measured difference in the message; ``export_artifacts`` and ``kvserve
export`` then fail (non-zero exit) and leave nothing behind."""
from __future__ import annotations

import copy
import dataclasses
import re
import shutil

import numpy as np
import onnx
import pytest
import torch
from export_matrix import LOGIT_TOL, THREADS

from kvserve import cli
from kvserve.export import pipeline
from kvserve.export.parity import ParityError, ParityReport, gate, measure, parity_prompts
from kvserve.artifact.verify import VerifyError, verify_artifacts
from kvserve.artifact.portable import PortableLM

STEPS = 64


def _worst(report: ParityReport) -> float:
    return max(report.max_abs_logit_prefill, report.max_abs_logit_decode)


def _perturb(model):
    with torch.no_grad():
        model.lm_head.weight[7] += 0.05  # one vocabulary row (tied: its embedding too)
    return model


def test_gate_rules():
    ok = ParityReport(2e-5, 3e-5, STEPS, 3, True, 1.0, None, None)
    gate(ok, LOGIT_TOL)
    assert ok.tolerance == LOGIT_TOL
    with pytest.raises(ParityError, match=r"max \|Δlogit\| 0\.00035 > tolerance 0\.0001 "
                                          r"\(prefill 2e-05, decode 0\.00035\)"):
        gate(dataclasses.replace(ok, max_abs_logit_decode=3.5e-4), LOGIT_TOL)
    with pytest.raises(ParityError, match="nan"):
        gate(dataclasses.replace(ok, max_abs_logit_prefill=float("nan")), LOGIT_TOL)
    with pytest.raises(ParityError, match=r"greedy tokens differ \(agreement 0\.9844\)"):
        gate(dataclasses.replace(ok, greedy_tokens_equal=False, token_agreement=189 / 192),
             LOGIT_TOL)
    gate(dataclasses.replace(ok, greedy_tokens_equal=False), LOGIT_TOL, require_tokens=False)
    # attention: relative to each probability (test_attention_gate.py has the exports)
    gate(dataclasses.replace(ok, max_abs_attention=1.63e-5, max_rel_attention=6e-5), LOGIT_TOL)
    with pytest.raises(ParityError, match=r"attention max \|Δp\|/\(p \+ 0\.002\) 0\.0008 > "
                                          r"0\.0005 \(\|Δp\| <= 0\.0005 p \+ 1e-06 fails"):
        gate(dataclasses.replace(ok, max_abs_attention=2e-5, max_rel_attention=8e-4), LOGIT_TOL)


def test_gate_catches_a_changed_torch_weight(main_model, main_lm):
    model = _perturb(copy.deepcopy(main_model))
    prompts = parity_prompts(model.cfg.vocab_size)
    report = measure(model, main_lm, prompts, STEPS)
    assert report.max_abs_logit_prefill > LOGIT_TOL and report.max_abs_logit_decode > LOGIT_TOL
    with pytest.raises(ParityError) as e:
        gate(report, LOGIT_TOL)
    msg = str(e.value)
    assert f"max |Δlogit| {_worst(report):.3g} > tolerance" in msg
    assert f"decode {report.max_abs_logit_decode:.3g}" in msg


def test_gate_catches_a_changed_decode_graph(main_model, store, tmp_path):
    """Portable graphs: only decode.onnx's weights change (x1.05): prefill still agrees,
    decode does not."""
    artifact_copy = tmp_path / "portable"
    shutil.copytree(store.artifact("llama", portable=True), artifact_copy)
    path = artifact_copy / "decode.onnx"
    m = onnx.load(str(path))  # with its external data
    scaled = 0
    for t in m.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2:
            a = onnx.numpy_helper.to_array(t) * np.float32(1.05)
            t.CopyFrom(onnx.numpy_helper.from_array(a, t.name))
            scaled += 1
    assert scaled >= 4
    for p in artifact_copy.glob("decode.onnx*"):
        p.unlink()
    onnx.save(m, str(path), save_as_external_data=True, location="decode.onnx.data",
              all_tensors_to_one_file=True, size_threshold=1024)
    lm = PortableLM(artifact_copy, provider="cpu", threads=THREADS, attention=False)
    report = measure(main_model, lm, parity_prompts(main_model.cfg.vocab_size), STEPS)
    assert report.max_abs_logit_prefill <= LOGIT_TOL < report.max_abs_logit_decode
    with pytest.raises(ParityError, match=re.escape(f"decode {report.max_abs_logit_decode:.3g})")):
        gate(report, LOGIT_TOL)
    with pytest.raises(VerifyError, match="decode.onnx.data does not match its sha256"):
        verify_artifacts(artifact_copy)  # and the edited artifact would not load in a server



def _perturbed_loader(monkeypatch):
    """The graphs are built from the checkpoint; the gate then compares them with a torch
    model whose weight changed."""
    real = pipeline.measure
    monkeypatch.setattr(pipeline, "measure",
                        lambda model, *a, **k: real(_perturb(copy.deepcopy(model)), *a, **k))


def test_export_artifacts_raises_and_leaves_nothing(main_ckpt, main_artifact, tmp_path,
                                                    monkeypatch):
    _perturbed_loader(monkeypatch)
    out = tmp_path / "out" / "art"
    with pytest.raises(ParityError, match=r"parity gate failed: max \|Δlogit\| \d[\d.e+-]* > "
                                          r"tolerance 0\.0001"):
        pipeline.export_artifacts(main_ckpt, out, attention=False, progress=False,
                                  threads=THREADS)
    assert not out.exists()
    assert list((tmp_path / "out").iterdir()) == []  # no temporary directory either


def test_cli_export_fails_nonzero_and_leaves_nothing(main_ckpt, main_artifact, tmp_path,
                                                     monkeypatch, capsys):
    _perturbed_loader(monkeypatch)
    out = tmp_path / "art"
    rc = cli.main(["export", str(main_ckpt), "--out", str(out), "--no-attention",
                   "--threads", str(THREADS)])
    err = capsys.readouterr().err
    assert rc == 1
    assert re.search(r"kvserve export: FAILED: parity gate failed: max \|Δlogit\| \S+ > "
                     r"tolerance 0\.0001 .*; no artifact written", err), err
    assert list(tmp_path.iterdir()) == []


def test_cli_export_and_verify_succeed(main_ckpt, main_artifact, tmp_path, monkeypatch,
                                       capsys):
    """The same path without the perturbation passes, writes a verified artifact, and refuses
    to overwrite it unless asked."""
    out = tmp_path / "art"
    argv = ["export", str(main_ckpt), "--out", str(out), "--no-attention",
            "--threads", str(THREADS)]
    assert cli.main(argv) == 0
    assert "greedy tokens equal: True" in capsys.readouterr().out
    assert cli.main(["verify", str(out)]) == 0
    assert "kvserve verify: OK" in capsys.readouterr().out
    assert cli.main(argv) == 2
    assert "exists" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_cli_export_of_optimised_int8_blocks_summarises_them(main_ckpt, tmp_path, capsys):
    """The transformed graphs' parity entry is named with --optimize ("int8+optimized"): the
    summary found it by the precision alone and ended in a KeyError after writing the
    artifact (found by a review)."""
    out = tmp_path / "art"
    assert cli.main(["export", str(main_ckpt), "--out", str(out), "--no-attention",
                     "--threads", str(THREADS), "--precision", "int8", "--int8-block-size",
                     "64", "--optimize"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"  int8\+optimized: max \|Δlogit\| \S+, greedy agreement \S+, blocks of "
                     r"64", printed), printed
    assert cli.main(["verify", str(out)]) == 0


def test_cli_export_signs_with_sign_key(main_ckpt, main_artifact, tmp_path, monkeypatch,
                                        capsys):
    """--sign-key: a bad key fails before any export work; a good one signs the manifest."""
    key = tmp_path / "keys" / "k"
    key.parent.mkdir()
    assert cli.main(["sign", "--generate-key", str(key)]) == 0
    out = tmp_path / "art"
    argv = ["export", str(main_ckpt), "--out", str(out), "--no-attention",
            "--threads", str(THREADS), "--sign-key"]
    capsys.readouterr()
    assert cli.main(argv + [str(tmp_path / "missing")]) == 2
    assert "cannot read signing key" in capsys.readouterr().err and not out.exists()
    assert cli.main(argv + [str(key)]) == 0
    assert "signed: " in capsys.readouterr().out
    assert cli.main(["verify", str(out), "--trusted-key", f"{key}.pub"]) == 0
    assert "manifest signed by the trusted key" in capsys.readouterr().out

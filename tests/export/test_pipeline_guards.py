"""export/pipeline.py's guards: the output never replaces its own checkpoint or a file; an
int8/int4 export of a checkpoint without a tokenizer is still gated on perplexity (on text
the fp32 model samples); a model whose context is shorter than the gate's default fits the
gate to it; ``--optimize`` keeps the attention-diagnostics graph."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from export_matrix import BASE, CONFIGS, LOGIT_TOL, THREADS

from kvserve.artifact.fused import FusedLM
from kvserve.export.pipeline import export_artifacts
from kvserve.export.precision import PrecisionError
from kvserve.model.checkpoint import save_checkpoint
from kvserve.model.config import ModelConfig
from kvserve.model.transformer import Transformer


def _export(ckpt, out, **kw):
    return export_artifacts(ckpt, out, progress=False, threads=THREADS, **kw)


def _ckpt(root, tokenizer_json=None, **cfg):
    torch.manual_seed(3)
    model = Transformer(ModelConfig(**{**BASE, **CONFIGS["llama"], **cfg})).eval()
    return save_checkpoint(root, model, tokenizer_json=tokenizer_json)


def test_the_output_is_never_the_checkpoint_or_a_file(store, tmp_path):
    ckpt = shutil.copytree(store.checkpoint("llama"), tmp_path / "runs" / "mine")
    before = sorted(p.name for p in ckpt.iterdir())
    for out in (ckpt, ckpt.parent, tmp_path):
        with pytest.raises(ValueError, match="is \\(or contains\\) the checkpoint"):
            _export(ckpt, out, overwrite=True)
    assert sorted(p.name for p in ckpt.iterdir()) == before
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileExistsError, match="is not a directory"):
        _export(ckpt, tmp_path / "afile", overwrite=True)


def test_quantized_exports_without_a_tokenizer_are_gated(tmp_path, monkeypatch):
    from kvserve.export import precision as prec

    ckpt = _ckpt(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="--eval-text needs"):
        _export(ckpt, tmp_path / "a", precision="int8", eval_text=__file__)
    calls, real = [], prec.perplexity

    def doubled_second(*a):  # the fp32 graph's perplexity, then twice the int8 graph's
        calls.append(1)
        return real(*a) * len(calls)

    with monkeypatch.context() as m:
        m.setattr(prec, "perplexity", doubled_second)
        with pytest.raises(PrecisionError, match=r"raises validation perplexity by \+\d"):
            _export(ckpt, tmp_path / "b", precision="int8", attention=False)  # the gate ran
    assert len(calls) == 2
    art = _export(ckpt, tmp_path / "c", precision="int4", attention=False)
    ppl = json.loads((art / "manifest.json").read_text())["perplexity"]
    assert ppl["eval_source"] == "sampled by the fp32 model" and ppl["eval_tokens"] > 100
    assert np.isfinite(ppl["relative_change"])


@pytest.mark.parametrize("bound", [-0.5, float("nan"), float("inf")])
def test_the_perplexity_bound_is_a_fraction_of_at_least_zero(store, tmp_path, bound):
    with pytest.raises(ValueError, match="--max-ppl-increase is a fraction >= 0"):
        _export(store.checkpoint("llama"), tmp_path / "a", precision="int8",
                max_ppl_increase=bound)
    assert not list(tmp_path.iterdir())


def test_a_short_context_fits_the_gate(tmp_path):
    art = _export(_ckpt(tmp_path / "ckpt", max_seq_len=48), tmp_path / "art", attention=False)
    parity = json.loads((art / "manifest.json").read_text())["parity"]["fp32"]
    assert parity["decode_steps"] == 48 - 12 - 1 and parity["max_abs_logit_decode"] <= LOGIT_TOL
    with pytest.raises(ValueError, match="too short for the parity gate"):
        _export(_ckpt(tmp_path / "tiny", max_seq_len=16), tmp_path / "art2")


def test_optimize_keeps_the_attention_graph(store, tmp_path):
    ckpt = store.checkpoint("llama")
    art = _export(ckpt, tmp_path / "art", optimize=True)
    plain = FusedLM(store.artifact("llama"), provider="cpu", threads=THREADS, attention=True)
    opt = FusedLM(art, provider="cpu", threads=THREADS, attention=True)
    ids = [[5, 9, 3, 7, 1, 2]]
    a = plain.prefill(plain.new_cache(1), 0, ids, attention=True)
    b = opt.prefill(opt.new_cache(1), 0, ids, attention=True)
    assert np.abs(a.logits[0] - b.logits[0]).max() <= LOGIT_TOL
    assert np.abs(a.attention[0] - b.attention[0]).max() <= 1e-5

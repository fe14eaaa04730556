"""Logits for the rows a call needs: a generation prefill asks for each prompt's last row
(``last=True``), and the fused graph runs its head over those rows alone (``logits_rows``);
Score asks for all of them. The last rows agree with the all-rows call and with torch, for a
right-padded batch of different lengths, through ``prefill`` and ``extend``; an artifact
exported before ``logits_rows`` existed gives the same answers."""
from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from export_matrix import LOGIT_TOL, THREADS

from kvserve.artifact.fused import FusedLM
from kvserve.artifact.spec import FusedSpec
from kvserve.export import fused

LENGTHS = (9, 3, 14)


def _prompts(vocab: int) -> list[list[int]]:
    g = np.random.default_rng(21)
    return [g.integers(0, vocab, n).tolist() for n in LENGTHS]


def _torch_last(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


def _check_last_rows(lm, model) -> None:
    prompts = _prompts(model.cfg.vocab_size)
    every = lm.prefill(lm.new_cache(3), 0, prompts).logits  # (T_b, V) each
    kv = lm.new_cache(3)
    last = lm.prefill(kv, 0, prompts, last=True).logits  # (1, V) each
    for p, a, b in zip(prompts, every, last):
        assert a.shape == (len(p), model.cfg.vocab_size) and b.shape == (1, model.cfg.vocab_size)
        assert np.abs(b[0] - a[-1]).max() <= 1e-5  # one row through the head, or all of them
        assert np.abs(b[0] - _torch_last(model, p)).max() <= LOGIT_TOL
    # the cache is the same as after an all-rows prefill: a chunk and a step after it agree
    more = [5, 6, 7, 8]
    got = lm.extend(kv, 1, np.array(more), last=True)
    assert got.shape == (1, model.cfg.vocab_size)
    assert np.abs(got[0] - _torch_last(model, prompts[1] + more)).max() <= LOGIT_TOL
    step, _ = lm.decode(kv, 3, np.array([1, 2, 3]))
    assert np.abs(step[1] - _torch_last(model, prompts[1] + more + [2])).max() <= LOGIT_TOL
    assert np.abs(step[2] - _torch_last(model, prompts[2] + [3])).max() <= LOGIT_TOL


def test_last_rows(lm, main_model):
    """Fused (the head over the last rows only) and portable (all rows, the last ones kept)."""
    _check_last_rows(lm, main_model)
    if lm.kind == "fused":  # the graph computed one row per prompt
        kv = lm.new_cache(2)
        bound = lm._run(kv, 0, np.array([[1, 2, 3], [4, 5, 0]]), np.array([3, 2]), False,
                        last=True)
        assert bound.logits.shape == (2, 1, main_model.cfg.vocab_size)


def test_artifact_without_logits_rows(artifacts, main_model, tmp_path):
    """A fused artifact from before ``logits_rows`` (no such input, logits for every position,
    no runtime entry) runs as before, and ``last=True`` still gives the last rows."""
    old = tmp_path / "old"
    shutil.copytree(artifacts["fused"], old)
    for f in old.glob("model.onnx*"):
        f.unlink()
    weights = {k: v.detach().float().numpy() for k, v in main_model.state_dict().items()}
    fused.save(fused.build_fused(main_model.cfg, weights, FusedSpec(logits_rows=None)),
               old / "model.onnx")
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["runtime"]["logits_rows"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    lm = FusedLM(old, provider="cpu", threads=THREADS, attention=False)
    assert lm.spec_for(False).logits_rows is None
    assert "logits_rows" not in {i.name for i in lm.session(False).get_inputs()}
    _check_last_rows(lm, main_model)

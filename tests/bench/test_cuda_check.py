"""The CUDA check's logic (bench/cuda_check.py) on the CPU provider against itself, on a tiny
fused artifact: the figures it reports are computed and sane. On a GPU machine the same code
compares CUDA with CPU (``kvserve bench --provider cuda``)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.checkpoint import save_checkpoint
    from kvserve.model.config import ModelConfig
    from kvserve.model.transformer import Transformer

    root = tmp_path_factory.mktemp("cuda_check")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=1100, init_std=0.1)
    ckpt = save_checkpoint(root / "ckpt", Transformer(cfg).eval())
    return export_artifacts(ckpt, root / "art", attention=False, progress=False, threads=1)


def test_cuda_check_logic_on_cpu(tiny):
    from kvserve.bench import cuda_check as cc

    a, b = cc._lm(tiny, "cpu", 1), cc._lm(tiny, "cpu", 1)
    prompts = np.random.default_rng(0).integers(2, 300, (3, 8))
    tf = cc.teacher_forced(a, b, prompts, 16)
    assert tf["rows"] == 3 and tf["steps"] == 16 and tf["max_abs_logit"] <= 1e-5
    ga, gb = cc.greedy(a, prompts, 16), cc.greedy(b, prompts, 16)
    assert ga.shape == (3, 16) and (ga == gb).all()
    assert cc.tok_per_s(a, prompts[:1], 8, repeats=1) > 0
    assert cc.step_ms(a, 2, 1000, 300, steps=4) > 0

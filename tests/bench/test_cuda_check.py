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


def test_a_precision_section_and_its_report(artifact):
    """A precision's section on the CPU against itself (exact), the targets read from it, and
    the Markdown of a results file with it, a failed precision and the size's other lines."""
    from kvserve.bench import cuda_check as cc
    from kvserve.bench import cuda_report

    p = cc._precision(artifact.dir, "cpu", 1, artifact.cfg.vocab_size, rows=2, steps=4)
    assert p["teacher_forced"]["max_abs_logit"] == 0.0 and p["greedy"]["equal"]
    assert p["engine_exactness"]["ok"] and p["bs1_tok_s"] > 0
    size = {"size": "tiny", "fp32": p, "int4": {"error": "RuntimeError: no kernel here"},
            "fp16_perplexity": {"relative_change": 1e-5},
            "server": {"tokens_equal": True, "tokens": 32},
            "engine_repeatability": {"off_a~on": {"tokens_equal": False,
                                                  "differing": ["w/0"], "errors": []},
                                     "seconds": 1.0}}
    t = cc._targets(size)
    assert t["greedy_equal_fp32"] and t["teacher_forced_fp32_le_1e-4"]
    assert t["engine_features_exact_fp32"] and t["served_equals_in_process"]
    md = cuda_report.render({"provider": "cpu", "versions": {"onnxruntime": "x"},
                             "sizes": [size]})
    assert "| fp32 | 0 | 100.0% | yes" in md and "| int4 | does not run: no kernel here" in md
    assert "(1 pairs of engine runs): parted: off_a~on" in md


def test_input_homes():
    """Where a session reads its inputs, from onnxruntime's memory infos: a CUDA allocator's
    (not pinned, not a CPU-input type) is the device's; unknown without the API."""
    import onnxruntime as ort

    from kvserve.artifact.providers import input_homes

    class Info:
        def __init__(self, name, mem=ort.OrtMemType.DEFAULT):
            self.name, self.mem_type = name, mem

    class Meta:
        def __init__(self, name):
            self.name = name

    class Sess:
        def get_inputs(self):
            return [Meta(n) for n in ("ids", "seqlens_k", "total", "past")]

        def get_input_memory_infos(self):
            return [Info("Cuda"), Info("Cpu"), Info("Cuda", ort.OrtMemType.CPU_INPUT),
                    Info("CUDA")]

    assert input_homes(Sess(), "cuda") == {"ids": "cuda", "seqlens_k": "cpu", "total": "cpu",
                                           "past": "cuda"}
    assert input_homes(Sess(), "cpu") == dict.fromkeys(("ids", "seqlens_k", "total", "past"),
                                                       "cpu")

    class Old(Sess):
        get_input_memory_infos = None
    assert input_homes(Old(), "cuda") is None

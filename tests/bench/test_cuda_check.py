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


def test_model_calls_replayed_give_the_engines_logits(artifact):
    """bench.call_replay on the CPU: the check's workload through an engine (a long prompt in
    chunks beside two streams, slot moves and cache growth included), its model calls
    replayed on fresh caches, one session and another: every call's logits bit for bit the
    engine's (the engine adds nothing to its calls); the recording stops when asked."""
    from kvserve.artifact.loader import load_lm
    from kvserve.bench import call_replay
    from kvserve.bench import cuda_engine as E

    cfg = artifact.cfg
    waves = E.workload(cfg.vocab_size, cfg.max_seq_len, chunk=64)
    assert len(waves) == 4  # (the long prompt's wave too, fed in chunks of 64)
    rng = np.random.default_rng(1)  # and the first of three leaving first: a slot move
    waves.append({"name": "moves", "requests": [
        E._request(rng.integers(2, cfg.vocab_size, 9 + i).tolist(), n)
        for i, n in enumerate((3, 20, 20))]})
    e = E.engine(artifact.dir, "cpu", 1, False, chunk=64)
    try:
        rec = call_replay.Recording(e)
        E.run_workload(e, waves)
        rec.stop()
        calls = len(rec.logits)
        E.run_workload(e, waves[:1])
    finally:
        e.stop()
    assert len(rec.logits) == calls
    assert not {"prefill", "decode", "verify"} & set(vars(e.runner.lm))  # (the class's again)
    kinds = {op["op"] for op in rec.ops}
    assert {"prefill", "decode", "move", "_reallocate"} <= kinds, kinds
    lm = load_lm(artifact.dir, provider="cpu", threads=1, attention=False)
    first = call_replay.replay(lm, rec)
    fresh = call_replay.replay(load_lm(artifact.dir, provider="cpu", threads=1,
                                       attention=False), rec)
    for a, b in ((rec.logits, first), (first, call_replay.replay(lm, rec)), (first, fresh)):
        assert call_replay.differing(a, b) == {"calls": calls, "differing": 0, "first": None,
                                               "max_abs_logit": 0.0}
    changed = [x.copy() for x in first]
    changed[3][0, 0] += 0.5
    assert call_replay.differing(first, changed) == {"calls": calls, "differing": 1,
                                                     "first": 3,
                                                     "max_abs_logit": pytest.approx(0.5)}


def test_report_renders_the_replays():
    from kvserve.bench import cuda_report

    size = {"size": "tiny", "engine_repeatability": {
        "off_a~off_b": {"tokens_equal": True, "differing": [], "errors": []},
        "runner_replays": {"engine~replay": {"calls": 9, "differing": 0, "first": None,
                                             "max_abs_logit": 0.0},
                           "replay~replay": {"calls": 9, "differing": 2, "first": 4,
                                             "max_abs_logit": 0.00098}}}}
    md = cuda_report.render({"provider": "cuda", "sizes": [size]})
    assert "(1 pairs of engine runs): all equal" in md
    assert ("calls whose logits differ: engine against replay 0 of 9; replay against replay "
            "2 of 9 (up to 0.00098)") in md


def test_a_recording_refuses_what_it_cannot_replay(artifact):
    """An engine with a prefix cache (its copies into slots are not recorded) and a runner
    other than the fused one (the portable runner's cache has more state) are refused."""
    from types import SimpleNamespace

    from kvserve.bench import call_replay
    from kvserve.bench import cuda_engine as E

    e = E.engine(artifact.dir, "cpu", 1, True, chunk=64)
    try:
        with pytest.raises(ValueError, match="prefix cache"):
            call_replay.Recording(e)
    finally:
        e.stop()
    portable = SimpleNamespace(runner=SimpleNamespace(
        sched=SimpleNamespace(kv=None), lm=SimpleNamespace(kind="portable"), prefix=None))
    with pytest.raises(ValueError, match="a portable runner"):
        call_replay.Recording(portable)

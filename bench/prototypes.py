"""Bench-local prototypes of fixes the profile points at, measured against the code as it is.
Nothing here is used by the server; the owners of server/ and model/ decide.

  python -m kvserve.bench.prototypes [ARTIFACT_DIR] [CKPT_DIR]

A. ``KVBuffers.append`` with a basic-slice fast path when every active slot writes the same
   row (always at batch 1, and whenever requests were admitted together): no index arrays, no
   fancy-indexing scatter.
B. A decode graph whose RMSNorm is written as ``x / sqrt(mean(x^2) + eps)`` (instead of
   ``x * rsqrt(...)``): onnxruntime's SimplifiedLayerNormalization fusion matches that form.
   On the export code of 2026-11-29 10:50 it cut the optimised decode graph from 273 to 219
   nodes; the export now emits ``RMSNormalization`` itself (190 nodes either way), so this
   prototype only confirms the node counts and that greedy tokens are unchanged.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np


# --- A. KVBuffers.append fast path ----------------------------------------------------------
def append_fast(kv, n: int, new_rows: list[np.ndarray]) -> None:
    rows = kv.used[:n]
    r0 = int(rows[0])
    if n == 1 or (rows == r0).all():  # one row index for every slot: a plain slice
        for i in range(kv.cfg.n_layers):
            kv.k[i][:n, :, r0] = new_rows[2 * i][:n, :, 0]
            kv.v[i][:n, :, r0] = new_rows[2 * i + 1][:n, :, 0]
        kv.mask[:n, r0] = 1
    else:
        b = np.arange(n)
        for i in range(kv.cfg.n_layers):
            kv.k[i][b, :, rows] = new_rows[2 * i][:n, :, 0]
            kv.v[i][b, :, rows] = new_rows[2 * i + 1][:n, :, 0]
        kv.mask[b, rows] = 1
    kv.used[:n] += 1


def bench_append(artifact: str, batch: int, reps: int = 2000) -> dict:
    from kvserve.model.config import ModelConfig
    from kvserve.server.runtime import KVBuffers

    cfg = ModelConfig.load(Path(artifact) / "config.json")
    rows = [np.random.rand(batch, cfg.n_kv_heads, 1, cfg.head_dim).astype(np.float32)
            for _ in range(2 * cfg.n_layers)]
    out = {}
    for label, fn in (("current", KVBuffers.append), ("fast path", append_fast)):
        kv = KVBuffers(cfg, batch, capacity=reps + 8)
        kv.used[:batch] = 4
        fn(kv, batch, rows)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(kv, batch, rows)
        out[label] = 1e6 * (time.perf_counter() - t0) / reps
        if label == "current":
            ref = [a.copy() for a in kv.k]
        else:
            assert all(np.array_equal(a, b) for a, b in zip(ref, kv.k))
    return {"batch": batch, "layers": cfg.n_layers, "us_per_call": out}


# --- B. fusable RMSNorm ------------------------------------------------------------------------
def _rmsnorm_div(self, x):
    import torch

    dtype = x.dtype
    x32 = x.float()
    x32 = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * x32.to(dtype)


def export_div_norm(ckpt: str, out: Path) -> Path:
    """The decode graph with the Div-form RMSNorm (same weights), checked against torch."""
    if (out / "decode.onnx").is_file():
        return out
    from kvserve.export.onnx_export import export_graph
    from kvserve.artifact.spec import DECODE
    from kvserve.model import layers
    from kvserve.model.checkpoint import load_model

    model = load_model(ckpt)
    orig = layers.RMSNorm.forward
    layers.RMSNorm.forward = _rmsnorm_div
    try:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        export_graph(model, DECODE, tmp)
        tmp.rename(out)
    finally:
        layers.RMSNorm.forward = orig
    return out


def optimized_ops(path: Path) -> dict:
    import collections

    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    tmp = path.parent / "_opt"
    tmp.mkdir(exist_ok=True)
    so.optimized_model_filepath = str(tmp / "opt.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                "opt.onnx.data")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    m = onnx.load(str(tmp / "opt.onnx"), load_external_data=False)
    shutil.rmtree(tmp)
    c = collections.Counter(n.op_type for n in m.graph.node)
    return {"nodes": len(m.graph.node), "ops": dict(c.most_common())}


def step_time(decode_path: Path, artifact: str, position: int, steps: int = 64,
              batch: int = 1) -> float:
    """Median ms of a decode step of ``decode_path`` run the way OnnxLM runs its decode graph
    (IO binding over KVBuffers), prompt K/V from the artifact's prefill graph."""
    import onnxruntime as ort

    from kvserve.bench.runners import prompts_for
    from kvserve.server.runtime import KVBuffers, OnnxLM, session_options

    lm = OnnxLM(artifact, provider="cpu", threads=2, attention=False)
    lm.sessions["decode"] = ort.InferenceSession(str(decode_path), session_options(2),
                                                 providers=["CPUExecutionProvider"])
    lm._bound.clear()
    prompt = prompts_for(batch, position, lm.cfg.vocab_size, seed=7)
    kv = KVBuffers(lm.cfg, batch, capacity=position + steps + 2)
    res = lm.prefill(prompt, np.ones_like(prompt))
    for b in range(batch):
        kv.load_prompt(b, res.present, b, position)
    tok = res.logits[:, -1].argmax(-1)
    dts, toks = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits, _ = lm.decode(kv, batch, tok, kv.used[:batch].copy())
        tok = logits.argmax(-1)
        dts.append(time.perf_counter() - t0)
        toks.append(int(tok[0]))
    return 1000 * statistics.median(dts), toks


def main(artifact: str, ckpt: str, out_root: Path) -> dict:
    res = {"append": [bench_append(artifact, b) for b in (1, 8, 16)]}
    proto = export_div_norm(ckpt, out_root / "div-norm")
    res["ops_current"] = optimized_ops(Path(artifact) / "decode.onnx")
    res["ops_div_norm"] = optimized_ops(proto / "decode.onnx")
    res["step_ms"] = {}
    for label, path in (("current", Path(artifact) / "decode.onnx"),
                        ("div_norm", proto / "decode.onnx")):
        for pos in (16, 256):
            for b in (1, 8):
                ms, toks = step_time(path, artifact, pos, batch=b)
                res["step_ms"][f"{label} b{b} pos{pos}"] = ms
                res.setdefault("tokens", {})[f"{label} b{b} pos{pos}"] = toks[:8]
    return res


if __name__ == "__main__":
    art = sys.argv[1] if len(sys.argv) > 1 else ".bench/models/bench-6m/fp32"
    ck = sys.argv[2] if len(sys.argv) > 2 else ".bench/models/bench-6m/ckpt"
    r = main(art, ck, Path(".bench/proto") / Path(art).parent.name)
    print(json.dumps(r, indent=1))

"""Rooflines: weight bytes a decode step reads vs the machine's memory read bandwidth, and the
arithmetic of a Score call vs the fp32 MatMul throughput onnxruntime reaches on this machine."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

ONNX_DTYPE_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8,
                    16: 2}


def decode_graph(artifact: str | Path) -> Path:
    """The graph a decode step runs: the fused graph, or a portable artifact's decode.onnx."""
    import json

    art = Path(artifact)
    runtime = json.loads((art / "manifest.json").read_text()).get("runtime") or {}
    graphs = runtime.get("graphs") or {}
    return art / graphs.get("main", graphs.get("decode", "decode.onnx"))


def decode_weight_bytes(graph: str | Path) -> dict:
    """Sum of the initializer bytes one decode step reads.

    Every initializer counts except the data input of a ``Gather`` (the token embedding: a step
    reads one row of it, not the table); that covers every matmul weight, the lm_head, norms and
    (int8) scales. Sizes come from the shapes, so external data is never loaded."""
    import onnx

    m = onnx.load(str(graph), load_external_data=False)
    sizes = {}
    for t in m.graph.initializer:
        n = int(np.prod(t.dims)) if len(t.dims) else 1
        sizes[t.name] = n * ONNX_DTYPE_BYTES.get(t.data_type, 4)
    gathered = {node.input[0] for node in m.graph.node if node.op_type == "Gather"
                and node.input[0] in sizes and sizes[node.input[0]] > (1 << 16)}
    read = sum(v for k, v in sizes.items() if k not in gathered)
    counts = {t.name: int(np.prod(t.dims)) if len(t.dims) else 1 for t in m.graph.initializer}
    weights = {node.input[1] for node in m.graph.node if node.op_type in ("MatMul", "Gemm")
               and len(node.input) > 1 and node.input[1] in counts}
    return {"read_bytes": read, "embedding_bytes": sum(sizes[k] for k in gathered),
            "all_initializer_bytes": sum(sizes.values()),
            # weights multiplied by every token (a float MatMul's weight elements: 2 flops each)
            "matmul_params": sum(counts[k] for k in weights)}


def matmul_peak(shapes: list[tuple[int, int, int]], threads: int = 2, repeats: int = 5
                ) -> dict:
    """fp32 MatMul throughput of onnxruntime's CPU provider (the kernels the artifacts run):
    one-node graphs (M, K) x (K, N), best of ``repeats`` per shape; ``gflops`` is the best
    shape's, a ceiling for any fp32 graph of those shapes on this machine."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    per_shape = {}
    for M, K, N in shapes:
        w = numpy_helper.from_array(rng.standard_normal((K, N), dtype=np.float32), "w")
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])], [w])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        sess = ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
        x = rng.standard_normal((M, K), dtype=np.float32)
        sess.run(None, {"x": x})
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            sess.run(None, {"x": x})
            best = min(best, time.perf_counter() - t0)
        per_shape[f"{M}x{K}x{N}"] = 2 * M * K * N / best / 1e9
    return {"threads": threads, "repeats": repeats, "gflops_by_shape": per_shape,
            "gflops": max(per_shape.values())}


def score_flops_per_token(matmul_params: int, n_layers: int, d_model: int, tokens: int
                          ) -> float:
    """Floating-point operations per token of a Score call over sequences of ``tokens``: every
    position goes through every MatMul (the lm_head included: log-softmax needs all the
    logits), and causal attention (QK and PV, 2 flops a multiply-add) over (tokens + 1) / 2
    positions on average."""
    return 2.0 * matmul_params + 4.0 * n_layers * d_model * (tokens + 1) / 2


def read_bandwidth(mb: int = 512, repeats: int = 5, threads: int = 2) -> dict:
    """Streaming read bandwidth: sum over an ``mb`` MB float64 array, best of ``repeats``; with
    one thread and with ``threads`` threads (numpy releases the GIL in the reduction)."""
    a = np.ones(mb * (1 << 20) // 8, np.float64)
    a.sum()  # fault the pages in

    def one() -> float:
        t0 = time.perf_counter()
        a.sum()
        return time.perf_counter() - t0

    def many() -> float:
        parts = np.array_split(a, threads)
        ts = [threading.Thread(target=p.sum) for p in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.perf_counter() - t0

    best1 = min(one() for _ in range(repeats))
    bestn = min(many() for _ in range(repeats))
    return {"array_mb": mb, "repeats": repeats, "gbps_1thread": mb * (1 << 20) / best1 / 1e9,
            f"gbps_{threads}threads": mb * (1 << 20) / bestn / 1e9,
            "gbps": max(mb * (1 << 20) / best1, mb * (1 << 20) / bestn) / 1e9}


def bandwidth_in_subprocess(mb: int, repeats: int, threads: int) -> dict:
    """In its own process, so the 512 MB array never inflates the caller's RSS."""
    return _in_subprocess(f"read_bandwidth({mb}, {repeats}, {threads})")


def peak_in_subprocess(shapes: list[tuple[int, int, int]], threads: int, repeats: int) -> dict:
    """In its own process, as the runners are (no session of the caller's shares its threads)."""
    return _in_subprocess(f"matmul_peak({[tuple(s) for s in shapes]!r}, {threads}, {repeats})")


def _in_subprocess(call: str) -> dict:
    import json
    import subprocess
    import sys

    code = (f"import json; from kvserve.bench.roofline import *; "
            f"print(json.dumps({call}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])

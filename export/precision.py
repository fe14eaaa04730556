"""Precision transforms of exported fp32 graphs, and the perplexity used to judge them.

- fp16: weights and compute in float16, graph inputs/outputs (and so the KV buffers) stay
  float32 (``keep_io_types``). Meant for the CUDA provider; on the CPU provider onnxruntime
  inserts casts around ops without fp16 kernels, so it runs there (that is how parity is
  measured) but is not faster.
- int8: ``onnxruntime.quantization.quantize_dynamic`` (weights int8, activations quantized
  per call): the documented CPU speed route.
- int4 (fused graphs): weight-only 4-bit blocks (``MatMulNBits``, block 32, symmetric), as
  onnxruntime-genai's builder makes for CPU.
On fused graphs fp16 also makes the KV buffers float16 (past and present are one buffer, so
they cannot keep float32 around a float16 op); logits stay float32.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx

from kvserve.artifact.providers import cpu_flags
from kvserve.model.sampling import log_softmax

log = logging.getLogger(__name__)

FP16_TOLERANCE = 5e-2  # max |Δlogit| vs the fp32 torch model, measured on CPU


class PrecisionError(RuntimeError):
    pass


INT4_BLOCK = 32


def convert(src: Path, dst: Path, precision: str) -> None:
    data_name = dst.name + ".data"
    fused = any(n.op_type == "GroupQueryAttention"
                for n in onnx.load(str(src), load_external_data=False).graph.node)
    if precision == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = onnx.load(str(src))  # with external data
        model = convert_float_to_float16(model, keep_io_types=["logits"] if fused else True,
                                         disable_shape_infer=fused)
        _toposort(model.graph)  # the converter appends its input casts after their users
        onnx.save(model, str(dst), save_as_external_data=True, location=data_name,
                  all_tensors_to_one_file=True, size_threshold=1024)
    elif precision == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                         use_external_data_format=True,
                         extra_options={"MatMulConstBOnly": True,
                                        # contrib ops (fused graphs) defeat shape inference
                                        "DefaultTensorType": onnx.TensorProto.FLOAT})
        # quantize_dynamic names the data file after dst; make it <name>.onnx.data
        model = onnx.load(str(dst))
        for p in dst.parent.glob(dst.name + "*"):
            if p != dst:
                p.unlink()
        onnx.save(model, str(dst), save_as_external_data=True, location=data_name,
                  all_tensors_to_one_file=True, size_threshold=1024)
    elif precision == "int4":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        if not fused:
            raise PrecisionError("int4 needs the fused graph")
        q = MatMulNBitsQuantizer(onnx.load(str(src)), bits=4, block_size=INT4_BLOCK,
                                 is_symmetric=True, accuracy_level=4)
        q.process()
        onnx.save(q.model.model, str(dst), save_as_external_data=True, location=data_name,
                  all_tensors_to_one_file=True, size_threshold=1024)
    else:
        raise ValueError(f"unknown precision {precision!r}")


def optimize_offline(path: Path) -> dict:
    """Replace ``path`` by onnxruntime's offline-optimised graph (CPU provider, extended
    level: fusions such as FusedMatMul / SkipLayerNorm in the com.microsoft domain). Returns
    what the result is tied to; the server refuses it on a machine without those features."""
    import onnxruntime as ort

    tmp_dir = path.parent / "_opt"
    tmp_dir.mkdir(exist_ok=True)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_dir / path.name)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                path.name + ".data")
    so.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for p in path.parent.glob(path.name + "*"):
        p.unlink()
    for p in tmp_dir.iterdir():
        p.rename(path.parent / p.name)
    tmp_dir.rmdir()
    return machine_features()


def machine_features() -> dict:
    """The provider, onnxruntime version and CPU instruction-set flags an offline-optimised
    graph is tied to."""
    import platform

    import onnxruntime as ort

    return {"provider": "CPUExecutionProvider", "onnxruntime": ort.__version__,
            "machine": platform.machine(), "cpu_flags": sorted(cpu_flags() & SIMD_FLAGS)}


SIMD_FLAGS = {"sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
              "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8",
              "amx_bf16", "asimd", "sve", "i8mm", "bf16"}


def _toposort(graph: onnx.GraphProto) -> None:
    """Reorder nodes so every input is produced before it is used (onnx.checker needs it)."""
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        rest = []
        for node in pending:
            if all(i in known for i in node.input):
                ordered.append(node)
                known.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise PrecisionError("fp16 conversion produced a graph with a cycle or a "
                                 "missing input")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


def perplexity(lm, ids: list[int], window: int) -> float:
    """Perplexity of ``ids`` through the runner's prefill, in non-overlapping windows."""
    window = max(2, min(window, 512))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = np.asarray(ids[start:start + window + 1], dtype=np.int64)
        if len(chunk) < 2:
            break
        kv = lm.new_cache(1, capacity=len(chunk))
        logits = lm.prefill(kv, 0, [chunk[:-1]]).logits[0]
        lp = log_softmax(logits)  # (T, V)
        nll -= float(lp[np.arange(len(chunk) - 1), chunk[1:]].sum())
        count += len(chunk) - 1
    return float(np.exp(nll / count))

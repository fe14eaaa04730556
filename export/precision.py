"""Precision transforms of exported fp32 graphs, and the perplexity used to judge them.

- fp16: weights and compute in float16, graph inputs/outputs (and so the KV buffers) stay
  float32 (``keep_io_types``). Meant for the CUDA provider; on the CPU provider onnxruntime
  inserts casts around ops without fp16 kernels, so it runs there (that is how parity is
  measured) but is not faster.
- int8: integer MatMuls in standard ops (``quantize_int8_rows``): weights int8 per output
  column, activations quantized per row when the graph runs, so a sequence's logits do not
  depend on the rest of its batch. With a block size (fused graphs): 8-bit ``MatMulNBits``
  blocks instead, one op a matmul: faster at batch 1, slower at batch 8, and its logits move a
  little with the batch (measured in bench/results/int8-blocks.md).
- int4 (fused graphs): weight-only 4-bit blocks (``MatMulNBits``, symmetric), blocks of 32
  weights by default, as onnxruntime-genai's builder makes for CPU; blocks of 64 store 4.5 bits
  a weight (llama.cpp's q4_0 size) and 128 4.25, faster to read and a little less exact
  (``BLOCKS``; measured in bench/results/int4-blocks.md).
On fused graphs fp16 also makes the KV buffers float16 (past and present are one buffer, so
they cannot keep float32 around a float16 op); logits stay float32.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx

from kvserve.artifact.native_build import cpu_flags
from kvserve.model.sampling import log_softmax

log = logging.getLogger(__name__)

FP16_TOLERANCE = 5e-2  # max |Δlogit| vs the fp32 torch model, measured on CPU


class PrecisionError(RuntimeError):
    pass


INT4_BLOCK = 32  # weights per 4-bit block (one float32 scale each): the default
BLOCKS = (16, 32, 64, 128, 256)  # what MatMulNBits takes (a power of two, >= 16)
BITS = {"int4": 4, "int8": 8}  # the precisions MatMulNBits can store


# where pairing the fused graph's attention (``FusedSpec.paired``) makes every row alike:
# wherever the matmuls compute a row alike at every batch size as well (measured: int8 per
# row and in 8-bit blocks up to 64, int4 blocks up to 32; int4 blocks of 64 and 8-bit blocks
# of 128 take another kernel for a single row, so pairing them only costs)
PAIRED_MAX_BLOCK = {"int8": 64, "int4": 32}


def pairing_helps(precision: str, block: int | None = None) -> bool:
    """Whether a paired export of ``precision`` in MatMulNBits blocks of ``block`` (None: int8
    per row) computes every row alike on the machines measured (fp32 and fp16: rows already
    within ~1e-6 / unmeasured; the server's startup check decides in the end)."""
    limit = PAIRED_MAX_BLOCK.get(precision)
    return limit is None or block is None or block <= limit


def block_size(precision: str, int4_block: int | None = None,
               int8_block: int | None = None) -> int | None:
    """The MatMulNBits block size an export's graphs take: int4 always (None:
    ``INT4_BLOCK``), int8 when asked (None: per-row int8 in standard ops). Refused where it
    cannot apply, before any export work."""
    for name, block in (("int4", int4_block), ("int8", int8_block)):
        if block is not None and precision != name:
            raise ValueError(f"the {name} block size applies to --precision {name} only, not "
                             f"{precision}")
        if block is not None and block not in BLOCKS:
            raise ValueError(f"the {name} block size must be one of "
                             f"{', '.join(map(str, BLOCKS))}, got {block}")
    if precision == "int4":
        return INT4_BLOCK if int4_block is None else int4_block
    return int8_block if precision == "int8" else None


def quantization(precision: str, block: int | None, graph: Path) -> dict | None:
    """The manifest's ``quantization`` entry for MatMulNBits graphs (int4, int8 in blocks):
    their blocks and the bits a weight the converted ``graph``'s MatMulNBits initializers
    hold (the bits + one float32 scale per block, more where a column shorter than a block, or
    not a multiple of it, is padded to whole blocks)."""
    if block is None or precision not in BITS:
        return None
    return {"op": "MatMulNBits", "bits": BITS[precision], "symmetric": True,
            "block_size": block, "bits_per_weight": round(stored_bits_per_weight(graph), 4)}


def stored_bits_per_weight(graph: Path) -> float:
    """Bits a weight of ``graph``'s MatMulNBits products: their weight and scale initializers'
    bytes (from the shapes; external data is not read) over their K x N weights."""
    from onnx import helper

    m = onnx.load(str(graph), load_external_data=False)
    sizes = {t.name: int(np.prod(t.dims))
             * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize for t in m.graph.initializer}
    stored = weights = 0
    for node in m.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            weights += attrs["K"] * attrs["N"]
            stored += sizes.get(node.input[1], 0) + sizes.get(node.input[2], 0)
    if not weights:
        raise PrecisionError(f"{graph.name} has no MatMulNBits product")
    return 8 * stored / weights


def convert(src: Path, dst: Path, precision: str, block: int | None = None) -> None:
    """``block``: MatMulNBits' block size (int4; int8 in blocks), None for per-row int8."""
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
    elif precision == "int8" and block is None:
        model = quantize_int8_rows(onnx.load(str(src)))  # with external data
        onnx.save(model, str(dst), save_as_external_data=True, location=data_name,
                  all_tensors_to_one_file=True, size_threshold=1024)
    elif precision in BITS:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        if not fused:
            raise PrecisionError(f"{precision} in MatMulNBits blocks needs the fused graph")
        q = MatMulNBitsQuantizer(onnx.load(str(src)), bits=BITS[precision],
                                 block_size=block or INT4_BLOCK, is_symmetric=True,
                                 accuracy_level=4)
        q.process()
        onnx.save(q.model.model, str(dst), save_as_external_data=True, location=data_name,
                  all_tensors_to_one_file=True, size_threshold=1024)
    else:
        raise ValueError(f"unknown precision {precision!r}")


INT8_WEIGHT_MAX = 63  # 7-bit weights: see quantize_int8_rows
INT8_ACT_MAX = 127


def quantize_int8_rows(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every float MatMul with a constant 2-D weight becomes an integer MatMul, in standard ONNX
    ops (the portable graphs stay portable):

    - weights: int8 with one scale per output column, in 7 bits (|q| <= 63), so that
      onnxruntime's u8 x s8 AVX2 kernel, which adds pairs of products in 16 bits, cannot
      saturate (255 * 63 * 2 < 32767);
    - activations: quantized per row (per token) when the graph runs, symmetric around the
      uint8 zero point 128 with the row's own scale max|x| / 127.

    A row's result therefore depends on that row alone: the same request gives the same
    logits alone and in any batch (``quantize_dynamic``, used before, takes one activation
    scale over the whole tensor, so a sequence's logits moved with its batch neighbours: up to
    0.12 on the 100M bench model, a logprob by 0.96 on another). The rows sharing an input
    (q, k and v of a portable graph) share its quantization."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    users: dict[str, int] = {}
    for node in g.node:
        for name in node.input:
            users[name] = users.get(name, 0) + 1
    consts = [
        numpy_helper.from_array(np.array([-1], np.int64), "q8.axes"),
        numpy_helper.from_array(np.array(1.0 / INT8_ACT_MAX, np.float32), "q8.inv"),
        numpy_helper.from_array(np.array(1e-30, np.float32), "q8.tiny"),
        numpy_helper.from_array(np.array(128.0, np.float32), "q8.offset"),
        numpy_helper.from_array(np.array(128, np.uint8), "q8.zero"),
    ]
    quantized: dict[str, tuple[str, str]] = {}  # activation -> (uint8 rows, row scales)
    nodes, new_inits, dropped = [], [], set()
    for node in g.node:
        t = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 \
            else None
        if t is None or t.data_type != TensorProto.FLOAT or len(t.dims) != 2:
            nodes.append(node)
            continue
        w = numpy_helper.to_array(t).astype(np.float32)  # (K, N)
        col = np.abs(w).max(axis=0) / INT8_WEIGHT_MAX  # (N,)
        col[col == 0] = 1.0
        wq = np.clip(np.rint(w / col), -INT8_WEIGHT_MAX, INT8_WEIGHT_MAX).astype(np.int8)
        base = f"q8.{node.output[0]}"  # (output names are unique in a graph)
        new_inits += [numpy_helper.from_array(wq, t.name + ".int8"),
                      numpy_helper.from_array(col.astype(np.float32), t.name + ".scale")]
        users[t.name] -= 1
        if not users[t.name]:
            dropped.add(t.name)
        a = node.input[0]
        if a not in quantized:
            p = f"q8.act{len(quantized)}"
            nodes += [
                helper.make_node("Abs", [a], [p + ".abs"]),
                helper.make_node("ReduceMax", [p + ".abs", "q8.axes"], [p + ".max"],
                                 keepdims=1),  # (..., 1)
                helper.make_node("Mul", [p + ".max", "q8.inv"], [p + ".s0"]),
                helper.make_node("Max", [p + ".s0", "q8.tiny"], [p + ".scale"]),
                helper.make_node("Div", [a, p + ".scale"], [p + ".x"]),
                helper.make_node("Round", [p + ".x"], [p + ".r"]),  # [-127, 127]
                helper.make_node("Add", [p + ".r", "q8.offset"], [p + ".o"]),  # [1, 255]
                helper.make_node("Cast", [p + ".o"], [p + ".q"], to=TensorProto.UINT8),
            ]
            quantized[a] = (p + ".q", p + ".scale")
        q, scale = quantized[a]
        nodes += [
            helper.make_node("MatMulInteger", [q, t.name + ".int8", "q8.zero"],
                             [base + ".acc"]),
            helper.make_node("Cast", [base + ".acc"], [base + ".f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [base + ".f", scale], [base + ".rows"]),
            helper.make_node("Mul", [base + ".rows", t.name + ".scale"], list(node.output)),
        ]
        log.debug("int8 rows: %s (%s x %s)", node.name, *w.shape)
    if not quantized:
        raise PrecisionError("int8: the graph has no float MatMul with a constant weight")
    del g.node[:]
    g.node.extend(nodes)
    kept = [t for t in g.initializer if t.name not in dropped]
    del g.initializer[:]
    g.initializer.extend(kept + new_inits + consts)
    return model


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

"""The fused graph's SwiGLU on kvserve's native library (``native/swiglu.cc``).

The export writes a gated feed-forward's activation as four ops: ``Split`` of the up
projection into [gate; up], ``Sigmoid`` of the gate, ``Mul`` (gate × its sigmoid: SiLU) and
``Mul`` by up; onnxruntime runs them as three kernels (it fuses the first product into
``QuickGelu``), each a pass over the activations and a dispatch of its own, which is most of
their cost in a decode step (a few thousand floats a layer). ``rewrite`` replaces each such
group, where nothing else reads its intermediate tensors, by one ``ai.kvserve.SwiGLU`` node;
``check`` compares the op with those four on random rows. Element-wise: a row's values do not
depend on the call's shape. ``native_attention.prepare`` runs both.
"""
from __future__ import annotations

import functools
from collections import defaultdict

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from .native_attention import DOMAIN, check_options, declare_domain
OP = "SwiGLU"
TOLERANCE = 1e-5  # the largest |difference| of the check's outputs over their largest


def _halves(split: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    """Whether ``split`` cuts its input's last axis into two equal halves."""
    attrs = {a.name: helper.get_attribute_value(a) for a in split.attribute}
    if len(split.output) != 2 or attrs.get("axis", 0) != -1:
        return False
    if len(split.input) > 1 and split.input[1]:
        sizes = inits.get(split.input[1])
        if sizes is None:
            return False
        a, b = numpy_helper.to_array(sizes).tolist()
        return a == b
    return attrs.get("num_outputs", 2) == 2


def groups(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, ...]]:
    """(split, sigmoid, silu, product) of every SwiGLU in the export's form whose
    intermediate tensors nothing else reads."""
    graph = model.graph
    made = {out: n for n in graph.node for out in n.output}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in graph.node:
        for name in n.input:
            readers[name].append(n)
    outputs = {o.name for o in graph.output}
    inits = {i.name: i for i in graph.initializer}
    found = []
    for prod in graph.node:
        if prod.op_type != "Mul" or prod.domain not in ("", "ai.onnx"):
            continue
        for act, up in (prod.input, prod.input[::-1]):
            silu = made.get(act)
            if silu is None or silu.op_type != "Mul":
                continue
            for gate, sig_out in (silu.input, silu.input[::-1]):
                sig, split = made.get(sig_out), made.get(gate)
                if sig is None or sig.op_type != "Sigmoid" or sig.input[0] != gate or \
                        split is None or split.op_type != "Split" or \
                        list(split.output) != [gate, up] or not _halves(split, inits):
                    continue
                inner = {gate: {id(silu), id(sig)}, up: {id(prod)}, sig_out: {id(silu)},
                         act: {id(prod)}}
                if any({id(r) for r in readers[t]} != who or len(readers[t]) != len(who)
                       or t in outputs for t, who in inner.items()):
                    continue
                found.append((split, sig, silu, prod))
                break
            else:
                continue
            break
    return found


def rewrite(model: onnx.ModelProto) -> int:
    """Each SwiGLU group of ``model`` becomes one op (float32 only: a graph with a half-
    precision input, output or annotated tensor keeps its ops), in place. Returns how many."""
    half = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
    if any(v.type.tensor_type.elem_type in half
           for v in (*model.graph.input, *model.graph.value_info, *model.graph.output)):
        return 0
    found = groups(model)
    if not found:
        return 0
    drop = {id(n) for g in found for n in g[:3]}
    keep = []
    for n in model.graph.node:
        if id(n) in drop:
            continue
        group = next((g for g in found if g[3] is n), None)
        if group is not None:
            n = helper.make_node(OP, [group[0].input[0]], [n.output[0]],
                                 name=f"{n.name}/swiglu", domain=DOMAIN)
        keep.append(n)
    del model.graph.node[:]
    model.graph.node.extend(keep)
    declare_domain(model)
    return len(found)


def _graph(native: bool, rows: int, F: int) -> bytes:
    f = TensorProto.FLOAT
    x = helper.make_tensor_value_info("x", f, [rows, 2 * F])
    y = helper.make_tensor_value_info("y", f, [rows, F])
    if native:
        nodes = [helper.make_node(OP, ["x"], ["y"], domain=DOMAIN)]
        inits = []
    else:
        inits = [numpy_helper.from_array(np.array([F, F], np.int64), "sizes")]
        nodes = [helper.make_node("Split", ["x", "sizes"], ["g", "u"], axis=-1),
                 helper.make_node("Sigmoid", ["g"], ["s"]),
                 helper.make_node("Mul", ["g", "s"], ["a"]),
                 helper.make_node("Mul", ["a", "u"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "swiglu", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    return model.SerializeToString()


@functools.cache
def check(library: str) -> float:
    """The op against the four ops on rows of random values (a decode row, a prefill's
    rows, values far into both tails): the largest difference over the largest output."""
    rng = np.random.default_rng(20261204)
    so = check_options(library)
    worst = 0.0
    for rows, F in ((1, 2048), (3, 1003), (300, 512)):
        x = (rng.standard_normal((rows, 2 * F)) * 4).astype(np.float32)
        x[0, :4] = [-120.0, -30.0, 30.0, 120.0]
        a, b = (ort.InferenceSession(_graph(n, rows, F), so, providers=["CPUExecutionProvider"])
                .run(None, {"x": x})[0] for n in (False, True))
        worst = max(worst, float(np.abs(a - b).max()) / max(float(np.abs(a).max()), 1e-6))
    return worst

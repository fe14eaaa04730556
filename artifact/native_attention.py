"""kvserve's own CPU attention kernel in place of onnxruntime's GroupQueryAttention.

onnxruntime's CPU GroupQueryAttention costs a batch-1 decode step 5-9x what reading its cache
rows would (bench/results/attention-cost.md: small GEMMs per head with their own packing, two
parallel sections a layer). ``native/attention.cc`` is one onnxruntime custom op
(``ai.kvserve.KVAttention``) for the subset of the op the fused graph uses: packed q/k/v,
the cache written in place, rotate-half RoPE from cos/sin tables, ``query_seqlens``, a sliding
window, soft-capping. Each (row, kv head, block of queries) is one task on onnxruntime's
intra-op pool, which reads each key and value row once for every query head that shares it.

``rewrite`` swaps the eligible nodes of a graph in memory (the artifact's file and its
manifest hash stay as they are: verified, then rewritten, as ``gqa_compat`` does); a node it
cannot take (attention weights out, interleaved rotary, a head size not a multiple of 8, a
cache not float32, inputs the op does not read) keeps onnxruntime's op. Before a session uses
the op, ``check`` runs both ops on random calls with each distinct attribute set of the graph
(decode rows, right-padded prompts, windows) and compares them: outside ``TOLERANCE`` the
session keeps onnxruntime's op and says why (``status``).

The library is built from source on the machine that runs it (``native_build``); without a
compiler, the headers, a CPU with the flags it was built for, or an onnxruntime of 1.32 or
later, the graph keeps onnxruntime's op; so does ``kvserve serve --attention-kernel
onnxruntime``. The same library holds ``native_swiglu``'s op, which ``prepare`` applies too.
"""
from __future__ import annotations

import functools
import logging
import weakref

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from .gqa_compat import gqa_takes_query_seqlens

log = logging.getLogger(__name__)

GQA = "GroupQueryAttention"
DOMAIN = "ai.kvserve"
OP = "KVAttention"
# the GroupQueryAttention inputs the op reads; any other one given keeps onnxruntime's op
_QKV, _PAST_K, _PAST_V, _SEQLENS, _TOTAL, _COS, _SIN, _QLENS = 0, 3, 4, 5, 6, 7, 8, 16
_READ = {_QKV, _PAST_K, _PAST_V, _SEQLENS, _TOTAL, _COS, _SIN, _QLENS}
_ATTRS = {"num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved",
          "local_window_size", "softcap", "smooth_softmax", "qk_output"}
TOLERANCE = 1e-4  # the largest |difference| of the check's outputs, relative to their scale
MODES = ("auto", "native", "onnxruntime")


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _kv_types(graph: onnx.GraphProto) -> dict[str, tuple[int, list]]:
    """Each graph input's element type and dims (ints where static)."""
    out = {}
    for i in graph.input:
        t = i.type.tensor_type
        out[i.name] = (t.elem_type, [d.dim_value if d.HasField("dim_value") else None
                                     for d in t.shape.dim])
    return out


def why_not(node: onnx.NodeProto, inputs: dict[str, tuple[int, list]]) -> str | None:
    """Why the op cannot take ``node`` (a GroupQueryAttention), None when it can."""
    a = _attrs(node)
    if set(a) - _ATTRS:
        return f"attributes {sorted(set(a) - _ATTRS)}"
    if len(node.output) != 3 or a.get("qk_output", 0):
        return "attention weights asked for"
    extra = [i for i, name in enumerate(node.input) if name and i not in _READ]
    if extra or len(node.input) <= _QLENS or not node.input[_QLENS]:
        return "inputs the op does not read, or no query_seqlens"
    if a.get("smooth_softmax", 0):
        return "smooth softmax"
    if a.get("do_rotary", 0) and (a.get("rotary_interleaved", 0)
                                   or not node.input[_COS] or not node.input[_SIN]):
        return "interleaved rotary"
    heads, kv_heads = a["num_heads"], a["kv_num_heads"]
    if kv_heads < 1 or heads % kv_heads or heads // kv_heads > 16:
        return f"{heads} query heads over {kv_heads} kv heads"
    elem, dims = inputs.get(node.input[_PAST_K], (None, []))
    if elem != TensorProto.FLOAT or len(dims) != 4 or not dims[3] or dims[3] % 8 \
            or dims[3] > 256:
        return "a cache not float32, or a head size not a multiple of 8 up to 256"
    return None


def rewrite(model: onnx.ModelProto) -> int:
    """Each GroupQueryAttention of ``model`` the op can take becomes the op, in place.
    Returns how many nodes changed."""
    graph, changed = model.graph, 0
    inputs = _kv_types(graph)
    for idx, node in enumerate(graph.node):
        if node.op_type != GQA or why_not(node, inputs) is not None:
            continue
        a = _attrs(node)
        head = inputs[node.input[_PAST_K]][1][3]
        scale = float(a.get("scale", 0.0)) or 1.0 / float(np.sqrt(head))
        rotary = bool(a.get("do_rotary", 0))
        ins = [node.input[i] for i in (_QKV, _PAST_K, _PAST_V, _SEQLENS, _QLENS)]
        if rotary:
            ins += [node.input[_COS], node.input[_SIN]]
        graph.node[idx].CopyFrom(helper.make_node(
            OP, ins, list(node.output), name=node.name, domain=DOMAIN,
            num_heads=int(a["num_heads"]), kv_num_heads=int(a["kv_num_heads"]), scale=scale,
            local_window_size=int(a.get("local_window_size", -1)),
            softcap=float(a.get("softcap", 0.0))))
        changed += 1
    if changed:
        declare_domain(model)
    return changed


def declare_domain(model: onnx.ModelProto) -> None:
    """The library's op domain in ``model``'s opset imports (once), after a rewrite."""
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def check_options(library: str) -> ort.SessionOptions:
    """Session options for a load-time check of the library's ops against onnxruntime's."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 2
    so.register_custom_ops_library(library)
    return so


def attribute_sets(model: onnx.ModelProto) -> list[dict]:
    """The distinct (heads, kv heads, head size, window, softcap, rotary width) of the
    graph's rewritable nodes: what ``check`` runs."""
    inputs, inits = _kv_types(model.graph), {i.name: i for i in model.graph.initializer}
    seen: dict[tuple, dict] = {}
    for node in model.graph.node:
        if node.op_type != GQA or why_not(node, inputs) is not None:
            continue
        a = _attrs(node)
        rot = 0
        if a.get("do_rotary", 0):
            cos = inits.get(node.input[_COS])
            rot = int(cos.dims[1]) if cos is not None else -1
        key = (int(a["num_heads"]), int(a["kv_num_heads"]), int(inputs[node.input[_PAST_K]][1][3]),
               int(a.get("local_window_size", -1)), float(a.get("softcap", 0.0)), rot,
               float(a.get("scale", 0.0)))
        seen[key] = dict(zip(("heads", "kv_heads", "head", "window", "softcap", "rotary",
                              "scale"), key))
    return list(seen.values())


def _one_node_graph(op: str, s: dict, batch: int, S: int, capacity: int) -> bytes:
    """A graph of one attention node (``GroupQueryAttention`` or the op) with ``s``'s
    attributes: inputs qkv, past_key, past_value, seqlens_k, total, query_seqlens, cos, sin."""
    H, Hkv, D = s["heads"], s["kv_heads"], s["head"]
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    kv = [batch, Hkv, capacity, D]
    rot = s["rotary"] > 0
    vi = [helper.make_tensor_value_info("qkv", f, [batch, S, (H + 2 * Hkv) * D]),
          helper.make_tensor_value_info("past_key", f, kv),
          helper.make_tensor_value_info("past_value", f, kv),
          helper.make_tensor_value_info("seqlens_k", i32, [batch]),
          helper.make_tensor_value_info("total", i32, []),
          helper.make_tensor_value_info("query_seqlens", i32, [batch])]
    if rot:
        vi += [helper.make_tensor_value_info(n, f, [capacity, s["rotary"]]) for n in ("cos", "sin")]
    outs = [helper.make_tensor_value_info("out", f, [batch, S, H * D]),
            helper.make_tensor_value_info("present_key", f, kv),
            helper.make_tensor_value_info("present_value", f, kv)]
    common = dict(num_heads=H, kv_num_heads=Hkv, local_window_size=s["window"],
                  softcap=s["softcap"])
    if op == GQA:
        ins = ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total",
               *(["cos", "sin"] if rot else ["", ""]), "", "", "", "", "", "", "",
               "query_seqlens"]
        node = helper.make_node(GQA, ins, [o.name for o in outs], domain="com.microsoft",
                                do_rotary=int(rot), rotary_interleaved=0, scale=s["scale"],
                                **common)
    else:
        ins = ["qkv", "past_key", "past_value", "seqlens_k", "query_seqlens",
               *(["cos", "sin"] if rot else [])]
        node = helper.make_node(OP, ins, [o.name for o in outs], domain=DOMAIN,
                                scale=s["scale"] or 1.0 / float(np.sqrt(D)), **common)
    graph = helper.make_graph([node], "attention", vi, outs)
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
        helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    return model.SerializeToString()


def _calls(rng: np.random.Generator, capacity: int) -> list[tuple[list[int], list[int], int]]:
    """(rows before the call, new tokens, S) per check call: decode at batch 1 and 3 (short and
    long pasts), a prompt over several key tiles and query blocks, right-padded prompts, a
    ragged verification, a chunk after a long past."""
    return [([7], [1], 1), ([0, 3, capacity - 60], [1, 1, 1], 1), ([0], [70], 70),
            ([0, 12], [9, 17], 17), ([5, 0, capacity - 70], [4, 2, 1], 4),
            ([int(rng.integers(capacity // 2, capacity - 6))], [5], 5),
            ([capacity - 100], [40], 40)]


def check(library: str, s: dict, providers: list) -> float:
    """Both ops on the same random calls with attribute set ``s``: the largest difference of
    the outputs and the written cache rows, relative to the outputs' largest magnitude."""
    rng = np.random.default_rng(20261204)
    # (past the window, where there is one: the calls' last positions reach capacity - 1)
    capacity = max(200, s["window"] + 100)
    so = check_options(library)
    worst = 0.0
    for past, new, S in _calls(rng, capacity):
        B = len(past)
        sessions = [ort.InferenceSession(_one_node_graph(op, s, B, S, capacity), so,
                                         providers=providers) for op in (GQA, OP)]
        H, Hkv, D = s["heads"], s["kv_heads"], s["head"]
        feeds = {"qkv": rng.standard_normal((B, S, (H + 2 * Hkv) * D)).astype(np.float32),
                 "seqlens_k": np.array([p + n - 1 for p, n in zip(past, new)], np.int32),
                 "total": np.array(max(p + n for p, n in zip(past, new)), np.int32),
                 "query_seqlens": np.array(new, np.int32)}
        if s["rotary"] > 0:
            ang = rng.uniform(0, 2 * np.pi, (capacity, s["rotary"])).astype(np.float32)
            feeds["cos"], feeds["sin"] = np.cos(ang), np.sin(ang)
        cache = rng.standard_normal((2, B, Hkv, capacity, D)).astype(np.float32)
        results = []
        for sess in sessions:
            k, v = cache[0].copy(), cache[1].copy()
            binding = sess.io_binding()
            binding.bind_output("out")  # (first: outputs come back in the order bound)
            for name, arr in (("past_key", k), ("past_value", v)):
                binding.bind_cpu_input(name, arr)
                binding.bind_output(name.replace("past", "present"), "cpu", 0, np.float32,
                                    list(arr.shape), arr.ctypes.data)
            for name, arr in feeds.items():
                binding.bind_cpu_input(name, arr)
            sess.run_with_iobinding(binding)
            results.append((binding.copy_outputs_to_cpu()[0], k, v))
        (o1, k1, v1), (o2, k2, v2) = results
        scale = max(float(np.abs(o1).max()), 1e-6)
        for b, (p, n) in enumerate(zip(past, new)):
            worst = max(worst, float(np.abs(o1[b, :n] - o2[b, :n]).max()) / scale,
                        float(np.abs(k1[b, :, :p + n] - k2[b, :, :p + n]).max()),
                        float(np.abs(v1[b, :, :p + n] - v2[b, :, :p + n]).max()))
    return worst


@functools.cache
def _checked(library: str, key: tuple) -> float:
    return check(library, dict(zip(("heads", "kv_heads", "head", "window", "softcap", "rotary",
                                    "scale"), key)), ["CPUExecutionProvider"])


ONNXRUNTIME = "onnxruntime GroupQueryAttention"


def prepare(model: onnx.ModelProto, options: ort.SessionOptions, providers: list,
            mode: str = "auto") -> tuple[str, int]:
    """Rewrites ``model`` to the op where it can and may (``mode`` "auto" or "native"; the
    CPU provider, the library built and loadable, every attribute set checked against
    onnxruntime's op), registering the library with ``options``. Returns what the session
    will run, in words (for the log and tests), and how many nodes changed. ``mode``
    "native" raises where "auto" keeps onnxruntime's op."""
    from . import native_build, native_swiglu

    if mode not in MODES:
        raise ValueError(f"attention kernel {mode!r}: one of {', '.join(MODES)}")

    def keep(why: str) -> tuple[str, int]:
        if mode == "native":
            raise RuntimeError(f"attention kernel 'native' asked for, but {why}")
        return f"{ONNXRUNTIME} ({why})", 0

    if mode == "onnxruntime":
        return ONNXRUNTIME, 0
    first = providers[0] if isinstance(providers[0], str) else providers[0][0]
    if first != "CPUExecutionProvider":
        return keep(f"provider {first}")
    if not gqa_takes_query_seqlens():  # (the check's reference and the op's contract)
        return keep(f"onnxruntime {ort.__version__}: its GroupQueryAttention has no "
                    f"query_seqlens (1.32 or later)")
    library, why = native_build.library()
    if library is None:
        return keep(why)
    for s in attribute_sets(model):
        try:
            err = _checked(library, tuple(s.values()))
        except Exception as e:  # (a library this onnxruntime cannot load, ...)
            msg = f"the native op could not be checked ({str(e).splitlines()[0][:200]})"
        else:
            msg = "" if err <= TOLERANCE else \
                f"the native op differs from onnxruntime's by {err:.1e} (over {TOLERANCE})"
        if msg:
            log.warning("attention: %s; using onnxruntime's", msg)
            return keep(msg)
    n = rewrite(model)
    if not n:
        return keep("no node the native op takes")
    extra = ""
    try:
        swiglu = native_swiglu.check(library)
    except Exception as e:  # (attention passed its check: the library loads; still)
        swiglu, extra = float("nan"), f" ({str(e).splitlines()[0][:200]})"
    if swiglu <= native_swiglu.TOLERANCE:
        m = native_swiglu.rewrite(model)
        extra = f", SwiGLU ({m})" if m else ""
    else:
        log.warning("SwiGLU: the native op differs from onnxruntime's ops by %.1e%s; keeping "
                    "theirs", swiglu, extra)
        extra = ""
    if options not in _registered:  # (once per options object: a second registration of
        # the same domain fails the session)
        options.register_custom_ops_library(library)
        _registered.add(options)
    return f"kvserve native attention ({n} of the graph's attention nodes){extra}", n


_registered: "weakref.WeakSet[ort.SessionOptions]" = weakref.WeakSet()

"""The fused graph: one ONNX graph for prefill, chunked prefill and decode, built op by op.

As onnxruntime-genai's model builder does, attention is one ``com.microsoft.GroupQueryAttention``
per layer (MHA and MQA are its kv_heads = heads and = 1 cases) with rotary inside the op, and its
past and present share one preallocated buffer per layer that the op writes in place. Residual
adds are fused into the norms (``Skip[Simplified]LayerNormalization``), q/k/v are one MatMul.
Learned / sinusoidal positions, Post-Norm and biases sit outside the op.

I/O (``kvserve.artifact.spec.fused_io``): ``input_ids`` (B, S) right-padded; ``seqlens_k`` (B,)
= tokens in the cache after this call - 1; ``query_seqlens`` (B,) = valid tokens of this call;
``total_sequence_length`` () = max over the batch of seqlens_k + 1; the KV buffers (B, Hkv, C,
D). Row b's new tokens sit at cache rows [P, T) with T = seqlens_k + 1, P = T - query_seqlens,
and at positions P.. (a slot holds real tokens only, so row index == position).

What the op cannot express (``unsupported``) is exported as the portable graph instead.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvserve.artifact.spec import FusedSpec
from kvserve.model.config import ModelConfig

FUSED_OPSET = 23  # RMSNormalization (a standard op from 23) for the norms without a skip
MS = "com.microsoft"
GQA_HEAD_MULTIPLE = 16  # onnxruntime's CPU GroupQueryAttention needs head_size % 16 == 0


# options of imported model families that the fused graph does not build (yet): a model that
# sets one is exported portable (the torch-exported graphs carry every option)
_NOT_FUSED = {"rope_scaling": None, "rope_layers": None, "qk_norm": False, "embed_scale": None,
              "norm_offset": 0.0, "sandwich_norm": False, "attn_scale": None,
              "attn_softcap": None, "final_softcap": None, "sliding_window": None,
              "sliding_layers": None}
_FUSED_FFNS = ("gelu", "gelu_tanh", "relu", "swiglu")


def unsupported(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be built as a fused graph (empty: it can)."""
    why = []
    if cfg.head_dim % GQA_HEAD_MULTIPLE:
        why.append(f"head_dim {cfg.head_dim} is not a multiple of {GQA_HEAD_MULTIPLE} "
                   f"(onnxruntime's GroupQueryAttention on CPU)")
    if cfg.ffn not in _FUSED_FFNS:
        why.append(f"ffn {cfg.ffn!r} is not built into the fused graph")
    for name, default in _NOT_FUSED.items():
        if getattr(cfg, name, default) != default:
            why.append(f"{name} is not built into the fused graph")
    return why


class _Builder:
    def __init__(self, dtype):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.dtype = dtype
        self._n = 0

    def init(self, name: str, arr: np.ndarray, keep_dtype: bool = False) -> str:
        a = np.asarray(arr)
        if not keep_dtype and a.dtype.kind == "f":
            a = a.astype(self.dtype)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(a), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "",
           name: str | None = None, **attrs) -> list[str]:
        self._n += 1
        base = name or f"{op_type.lower()}_{self._n}"
        outs = [f"{base}/out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=base, domain=domain,
                                           **attrs))
        return outs

    def one(self, op_type: str, inputs: list[str], **kw) -> str:
        return self.op(op_type, inputs, **kw)[0]


def build_fused(cfg: ModelConfig, weights: dict[str, np.ndarray], spec: FusedSpec,
                dtype=np.float32) -> onnx.ModelProto:
    """The fused graph of ``cfg`` with ``weights`` (the torch state dict as numpy arrays)."""
    why = unsupported(cfg)
    if why:
        raise ValueError("no fused graph for this config: " + "; ".join(why))
    b = _Builder(dtype)
    W = weights
    T_FLOAT = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    L, H, Hkv, D, C = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    rms = cfg.norm == "rmsnorm"

    def linear(x: str, prefix: str) -> str:
        y = b.one("MatMul", [x, b.init(prefix + ".weight.T", W[prefix + ".weight"].T)])
        if prefix + ".bias" in W:
            y = b.one("Add", [y, b.init(prefix + ".bias", W[prefix + ".bias"])])
        return y

    def norm_params(prefix: str) -> list[str]:
        p = [b.init(prefix + ".weight", W[prefix + ".weight"])]
        if not rms:
            p.append(b.init(prefix + ".bias", W[prefix + ".bias"]))
        return p

    def norm(x: str, prefix: str) -> str:
        if rms:
            return b.one("RMSNormalization", [x, *norm_params(prefix)], axis=-1,
                         epsilon=cfg.norm_eps, stash_type=1)
        return b.one("LayerNormalization", [x, *norm_params(prefix)], axis=-1,
                     epsilon=cfg.norm_eps, stash_type=1)

    def skip_norm(delta: str, residual: str, prefix: str) -> tuple[str, str]:
        """norm(delta + residual), and the sum itself."""
        op = "SkipSimplifiedLayerNormalization" if rms else "SkipLayerNormalization"
        out = b.op(op, [delta, residual, *norm_params(prefix)], n_out=4, domain=MS,
                   epsilon=cfg.norm_eps)
        return out[0], out[3]

    # --- inputs and what the whole graph shares -------------------------------------------
    graph_inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64,
                                      ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch_size"]),
        helper.make_tensor_value_info("query_seqlens", TensorProto.INT32, ["batch_size"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    kv_shape = ["batch_size", Hkv, "max_cache_length", D]
    for i in range(L):
        for kv in ("key", "value"):
            graph_inputs.append(helper.make_tensor_value_info(spec.past(i, kv), T_FLOAT,
                                                              kv_shape))

    x = b.one("Gather", [b.init("tok_emb.weight", W["tok_emb.weight"]), "input_ids"])
    if cfg.positions in ("learned", "sinusoidal"):
        table = W["pos_emb.weight"] if cfg.positions == "learned" else \
            sinusoidal_table(cfg.max_seq_len, C)
        x = b.one("Add", [x, b.one("Gather", [b.init("pos_emb.table", table),
                                              _positions(b)])])  # (B, S, C)
    rope = []
    if cfg.positions == "rope":
        cos, sin = rope_cache(cfg.max_seq_len, D, cfg.rope_base)
        rope = [b.init("rope.cos", cos), b.init("rope.sin", sin)]

    # --- the blocks --------------------------------------------------------------------------
    pre = cfg.norm_placement == "pre"
    residual, delta = x, None  # pre-norm: the stream is residual (+ delta, not yet added)
    for i in range(L):
        p = f"layers.{i}"
        if pre:
            h, residual = (norm(residual, p + ".norm1"), residual) if delta is None else \
                skip_norm(delta, residual, p + ".norm1")
        else:
            h = residual
        qkv = linear(h, p + ".attn.qkv")  # (B, S, (H + 2 Hkv) D)
        gqa_in = [qkv, "", "", spec.past(i, "key"), spec.past(i, "value"), "seqlens_k",
                  "total_sequence_length", *(rope or ["", ""]), "", "", "", "", "", "", "",
                  "query_seqlens"]
        outs = [f"{p}/attn", spec.present(i, "key"), spec.present(i, "value")]
        if spec.attention:
            outs.append(spec.attn(i))
        b.nodes.append(helper.make_node(
            "GroupQueryAttention", gqa_in, outs, name=f"{p}/gqa", domain=MS, num_heads=H,
            kv_num_heads=Hkv, scale=1.0 / float(np.sqrt(D)), do_rotary=int(bool(rope)),
            rotary_interleaved=0, local_window_size=-1, softcap=0.0,
            **({"qk_output": 2} if spec.attention else {})))
        a = linear(f"{p}/attn", p + ".attn.out")  # (B, S, C)
        if pre:
            h, residual = skip_norm(a, residual, p + ".norm2")
        else:
            residual, _ = skip_norm(a, residual, p + ".norm1")
            h = residual
        f = _ffn(b, cfg, h, p + ".ffn", linear)
        if pre:
            delta = f
        else:
            residual, _ = skip_norm(f, residual, p + ".norm2")
    if pre:
        if cfg.final_norm:
            x, _ = skip_norm(delta, residual, "norm_f")
        else:
            x = b.one("Add", [delta, residual])
    else:
        x = norm(residual, "norm_f") if cfg.final_norm else residual
    lm_head = W.get("lm_head.weight", W["tok_emb.weight"])
    logits = b.one("MatMul", [x, b.init("lm_head.weight.T", lm_head.T)])  # (B, S, V)
    if dtype != np.float32:
        logits = b.one("Cast", [logits], to=TensorProto.FLOAT)
    b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits"))

    graph_outputs = [helper.make_tensor_value_info(
        "logits", TensorProto.FLOAT, ["batch_size", "sequence_length", cfg.vocab_size])]
    for i in range(L):
        for kv in ("key", "value"):
            graph_outputs.append(helper.make_tensor_value_info(spec.present(i, kv), T_FLOAT,
                                                               kv_shape))
    if spec.attention:
        for i in range(L):
            graph_outputs.append(helper.make_tensor_value_info(
                spec.attn(i), T_FLOAT,
                ["batch_size", H, "sequence_length", "total_sequence_length"]))
    graph = helper.make_graph(b.nodes, "kvserve-fused", graph_inputs, graph_outputs, b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", FUSED_OPSET),
                                                    helper.make_opsetid(MS, 1)],
                              producer_name="kvserve")
    model.ir_version = 10
    return model


def _positions(b: _Builder) -> str:
    """position_ids (B, S) int64 from the cache counters: P_b + s, P_b = seqlens_k + 1 - Q_b."""
    one = b.init("const.one_i32", np.array(1, np.int32), keep_dtype=True)
    past = b.one("Sub", [b.one("Add", ["seqlens_k", one]), "query_seqlens"])  # (B,)
    past = b.one("Cast", [past], to=TensorProto.INT64)
    shape = b.one("Shape", ["input_ids"])
    seq = b.one("Gather", [shape, b.init("const.one_i64", np.array(1, np.int64),
                                         keep_dtype=True)], axis=0)
    zero = b.init("const.zero_i64", np.array(0, np.int64), keep_dtype=True)
    step = b.init("const.step_i64", np.array(1, np.int64), keep_dtype=True)
    rng = b.one("Range", [zero, seq, step])  # (S,)
    axis1 = b.init("const.axis1", np.array([1], np.int64), keep_dtype=True)
    return b.one("Add", [b.one("Unsqueeze", [past, axis1]), rng])  # (B, S)


def _ffn(b: _Builder, cfg: ModelConfig, h: str, prefix: str, linear) -> str:
    up = linear(h, prefix + ".w_in")  # (B, S, F) or (B, S, 2F)
    if cfg.ffn == "swiglu":
        gate, val = b.op("Split", [up, b.init(prefix + ".split", np.array([cfg.d_ff, cfg.d_ff]),
                                              keep_dtype=True)], n_out=2, axis=-1)
        act = b.one("Mul", [b.one("Mul", [gate, b.one("Sigmoid", [gate])]), val])
    elif cfg.ffn == "gelu":
        act = b.one("Gelu", [up])
    elif cfg.ffn == "gelu_tanh":
        act = b.one("Gelu", [up], approximate="tanh")
    else:
        act = b.one("Relu", [up])
    return linear(act, prefix + ".w_out")


def rope_cache(max_len: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin (max_len, D/2) float32 for GroupQueryAttention's caches: the torch model's own
    tables (``model.layers``), so both sides rotate by the same numbers."""
    import torch

    from kvserve.model.layers import rope_cos_sin, rope_inv_freq

    pos = torch.arange(max_len)[None]  # (1, max_len)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(head_dim, base, None))  # (1, 1, max_len, D)
    half = head_dim // 2  # rotate-half layout: the two halves repeat
    return cos[0, 0, :, :half].numpy(), sin[0, 0, :, :half].numpy()


def sinusoidal_table(max_len: int, dim: int) -> np.ndarray:
    """PE (max_len, dim) float32: the torch model's table (``model.layers``)."""
    import torch

    from kvserve.model.layers import sinusoidal_table as table

    return table(torch.arange(max_len)[None], dim)[0].numpy()  # (max_len, dim)


def save(model: onnx.ModelProto, path: Path) -> None:
    """Graph in ``path``, weights in ``<name>.data`` beside it."""
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data",
              all_tensors_to_one_file=True, size_threshold=1024)


def save_attention_variant(main: Path, dst: Path) -> None:
    """The diagnostics graph: ``main`` with every GroupQueryAttention also returning its
    attention probabilities (``qk_output`` = 2, after softmax) as ``attn_weights.{i}``. It keeps
    pointing at ``main``'s weights file: the weights are stored once."""
    m = onnx.load(str(main), load_external_data=False)
    heads = None
    for node in m.graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        layer = int(node.name.split(".")[1].split("/")[0])
        node.attribute.append(helper.make_attribute("qk_output", 2))
        while len(node.output) < 3:
            node.output.append("")
        name = FusedSpec(attention=True).attn(layer)
        node.output.append(name)
        heads = next(a.i for a in node.attribute if a.name == "num_heads")
        kv_type = next(o for o in m.graph.output if o.name == node.output[1]).type
        m.graph.output.append(helper.make_tensor_value_info(
            name, kv_type.tensor_type.elem_type,
            ["batch_size", heads, "sequence_length", "total_sequence_length"]))
    if heads is None:
        raise ValueError(f"{main} has no GroupQueryAttention node")
    onnx.save(m, str(dst))  # the proto only: initializers keep pointing at main's data file

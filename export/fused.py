"""The fused graph: one ONNX graph for prefill, chunked prefill and decode, built op by op.

As onnxruntime-genai's model builder does, attention is one ``com.microsoft.GroupQueryAttention``
per layer (MHA and MQA are its kv_heads = heads and = 1 cases) with rotary inside the op, and its
past and present share one preallocated buffer per layer that the op writes in place. Residual
adds are fused into the norms (``Skip[Simplified]LayerNormalization``), q/k/v are one MatMul.
Learned / sinusoidal positions, Post-Norm and biases sit outside the op.

The options of imported families: the op's ``scale``, ``softcap`` and ``local_window_size``
(sliding windows, per layer) and ``do_rotary`` (per layer: SmolLM3's no-RoPE layers); scaled
RoPE (``linear``, ``llama3``) in the cos/sin tables; Gemma's ``(1 + w)`` norms folded into the
weights and its embedding scale a Mul; q/k RMSNorm, sandwich norms, GeGLU and final-logit
soft-capping as graph ops (``fused_ops``).

I/O (``kvserve.artifact.spec.fused_io``): ``input_ids`` (B, S) right-padded; ``seqlens_k`` (B,)
= tokens in the cache after this call - 1; ``query_seqlens`` (B,) = valid tokens of this call;
``total_sequence_length`` () = max over the batch of seqlens_k + 1; ``logits_rows`` (B, R) = the
positions of each row whose logits are computed (a prefill: its last, Score: all); the KV
buffers (B, Hkv, C, D). Row b's new tokens sit at cache rows [P, T) with T = seqlens_k + 1,
P = T - query_seqlens, and at positions P.. (a slot holds real tokens only, so row index ==
position).

What the op cannot express (``unsupported``) is exported as the portable graph instead.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from kvserve.artifact.spec import OPSET, FusedSpec
from kvserve.model.config import ModelConfig

from .fused_ops import MS, Builder, ffn, positions, qk_norm, rope_cache, sinusoidal_table, softcap

FUSED_OPSET = OPSET  # the artifact spec's (one opset for both kinds of graph)
GQA_HEAD_MULTIPLE = 16  # onnxruntime's CPU GroupQueryAttention needs head_size % 16 == 0


def unsupported(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be built as a fused graph (empty: it can)."""
    why = []
    if cfg.head_dim % GQA_HEAD_MULTIPLE:
        why.append(f"head_dim {cfg.head_dim} is not a multiple of {GQA_HEAD_MULTIPLE} "
                   f"(onnxruntime's GroupQueryAttention on CPU)")
    if (cfg.rope_scaling or {}).get("type") == "longrope":
        why.append("rope_scaling longrope switches between short and long factors per sequence "
                   "(GroupQueryAttention takes one cos/sin table)")
    return why


def build_fused(cfg: ModelConfig, weights: dict[str, np.ndarray], spec: FusedSpec,
                dtype=np.float32) -> onnx.ModelProto:
    """The fused graph of ``cfg`` with ``weights`` (the torch state dict as numpy arrays)."""
    why = unsupported(cfg)
    if why:
        raise ValueError("no fused graph for this config: " + "; ".join(why))
    b = Builder(dtype)
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
        # Gemma's (offset + w) RMSNorm: the offset is folded into the gain (float32, as torch)
        w = W[prefix + ".weight"] + np.float32(cfg.norm_offset) if rms else W[prefix + ".weight"]
        p = [b.init(prefix + ".weight", w)]
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
    if spec.logits_rows:
        graph_inputs.append(helper.make_tensor_value_info(spec.logits_rows, TensorProto.INT64,
                                                          ["batch_size", "logits_rows"]))
    kv_shape = ["batch_size", Hkv, "max_cache_length", D]
    for i in range(L):
        for kv in ("key", "value"):
            graph_inputs.append(helper.make_tensor_value_info(spec.past(i, kv), T_FLOAT,
                                                              kv_shape))

    x = b.one("Gather", [b.init("tok_emb.weight", W["tok_emb.weight"]), "input_ids"])
    if cfg.embed_scale is not None:  # Gemma: embeddings times sqrt(d_model)
        x = b.one("Mul", [x, b.init("embed_scale", np.array(cfg.embed_scale, np.float32))])
    if cfg.positions in ("learned", "sinusoidal"):
        table = W["pos_emb.weight"] if cfg.positions == "learned" else \
            sinusoidal_table(cfg.max_seq_len, C)
        x = b.one("Add", [x, b.one("Gather", [b.init("pos_emb.table", table),
                                              positions(b)])])  # (B, S, C)
    rope = []
    if cfg.positions == "rope":
        cos, sin = rope_cache(cfg.max_seq_len, D, cfg.rope_base, cfg.rope_scaling)
        rope = [b.init("rope.cos", cos), b.init("rope.sin", sin)]
    scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / float(np.sqrt(D))

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
        if cfg.qk_norm:
            qkv = qk_norm(b, cfg, qkv, *norm_params(p + ".attn.q_norm"),
                          *norm_params(p + ".attn.k_norm"))
        layer_rope = rope if cfg.layer_rope(i) else []
        window = cfg.layer_window(i)
        gqa_in = [qkv, "", "", spec.past(i, "key"), spec.past(i, "value"), "seqlens_k",
                  "total_sequence_length", *(layer_rope or ["", ""]), "", "", "", "", "", "",
                  "", "query_seqlens"]
        outs = [f"{p}/attn", spec.present(i, "key"), spec.present(i, "value")]
        if spec.attention:
            outs.append(spec.attn(i))
        b.nodes.append(helper.make_node(
            "GroupQueryAttention", gqa_in, outs, name=f"{p}/gqa", domain=MS, num_heads=H,
            kv_num_heads=Hkv, scale=float(scale), do_rotary=int(bool(layer_rope)),
            rotary_interleaved=0,
            # the op keeps the last local_window_size keys, the query's own included: our
            # (and Hugging Face's) sliding_window exactly (W - 1 fails the parity gate)
            local_window_size=-1 if window is None else window,
            softcap=float(cfg.attn_softcap or 0.0),
            **({"qk_output": 2} if spec.attention else {})))
        a = linear(f"{p}/attn", p + ".attn.out")  # (B, S, C)
        if cfg.sandwich_norm:  # Gemma 2: a norm on the branch output, before the residual add
            a = norm(a, p + ".norm1_post")
        if pre:
            h, residual = skip_norm(a, residual, p + ".norm2")
        else:
            residual, _ = skip_norm(a, residual, p + ".norm1")
            h = residual
        f = ffn(b, cfg, h, p + ".ffn", linear)
        if cfg.sandwich_norm:
            f = norm(f, p + ".norm2_post")
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
    if spec.logits_rows:  # only the rows asked for go through the head (a prefill: its last)
        rows = b.one("Unsqueeze", [spec.logits_rows, b.i64("const.axis_last", [-1])])  # (B, R, 1)
        x = b.one("GatherND", [x, rows], batch_dims=1)  # (B, R, C)
    lm_head = W.get("lm_head.weight", W["tok_emb.weight"])
    logits = b.one("MatMul", [x, b.init("lm_head.weight.T", lm_head.T)])  # (B, R, V)
    if dtype != np.float32:
        logits = b.one("Cast", [logits], to=TensorProto.FLOAT)
    if cfg.final_softcap is not None:
        logits = softcap(b, logits, cfg.final_softcap, "final_softcap")
    b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits"))

    graph_outputs = [helper.make_tensor_value_info(
        "logits", TensorProto.FLOAT,
        ["batch_size", "logits_rows" if spec.logits_rows else "sequence_length", cfg.vocab_size])]
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

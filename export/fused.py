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

I/O (named by ``kvserve.artifact.spec.FusedSpec``): ``input_ids`` (B, S) right-padded;
``seqlens_k`` (B,) = tokens in the cache after this call - 1; ``query_seqlens`` (B,) = valid
tokens of this call; ``total_sequence_length`` () = max over the batch of seqlens_k + 1;
``logits_rows`` (B, R) = the positions of each row whose logits are computed (a prefill: its
last, Score: all); the KV buffers (B, Hkv, C, D). Row b's new tokens sit at cache rows
[P, T) with T = seqlens_k + 1, P = T - query_seqlens, and at positions P.. (a slot holds real
tokens only, so row index == position).

What the op cannot express (``unsupported``) is exported as the portable graph instead.

``build_fused`` declares the I/O and calls one builder per block (``fused_blocks``: embedding,
attention, layer, head; the norms and linears they share); the export pipeline then holds the
graph to the parity gate, which raises (``ParityError``) rather than write an artifact.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from kvserve.artifact.spec import OPSET, FusedSpec
from kvserve.model.config import ModelConfig

from .fused_blocks import FusedBlocks
from .fused_ops import MS, Builder

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
    """The fused graph of ``cfg`` with ``weights`` (the torch state dict as numpy arrays):
    the blocks of ``fused_blocks`` in order, between the I/O ``spec`` names."""
    why = unsupported(cfg)
    if why:
        raise ValueError("no fused graph for this config: " + "; ".join(why))
    b = Builder(dtype)
    blocks = FusedBlocks(b, cfg, weights, spec)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = graph_inputs(cfg, spec, elem)
    residual, delta = blocks.embedding(), None
    for i in range(cfg.n_layers):
        residual, delta = blocks.layer(i, residual, delta)
    blocks.head(residual, delta, dtype)
    graph = helper.make_graph(b.nodes, "kvserve-fused", inputs, graph_outputs(cfg, spec, elem),
                              b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", FUSED_OPSET),
                                                    helper.make_opsetid(MS, 1)],
                              producer_name="kvserve")
    model.ir_version = 10
    return model


def _kv_shape(cfg: ModelConfig) -> list:
    return ["batch_size", cfg.n_kv_heads, "max_cache_length", cfg.head_dim]


def graph_inputs(cfg: ModelConfig, spec: FusedSpec, elem: int) -> list[onnx.ValueInfoProto]:
    """The graph's inputs, named by ``spec``; ``elem``: the KV buffers' element type."""
    vi = helper.make_tensor_value_info
    inputs = [
        vi("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        vi("seqlens_k", TensorProto.INT32, ["batch_size"]),
        vi("query_seqlens", TensorProto.INT32, ["batch_size"]),
        vi("total_sequence_length", TensorProto.INT32, []),
    ]
    if spec.logits_rows:
        inputs.append(vi(spec.logits_rows, TensorProto.INT64, ["batch_size", "logits_rows"]))
    for i in range(cfg.n_layers):
        for kv in ("key", "value"):
            inputs.append(vi(spec.past(i, kv), elem, _kv_shape(cfg)))
    return inputs


def graph_outputs(cfg: ModelConfig, spec: FusedSpec, elem: int) -> list[onnx.ValueInfoProto]:
    """The graph's outputs: float32 logits, the KV buffers, the attention probabilities."""
    vi = helper.make_tensor_value_info
    rows = "logits_rows" if spec.logits_rows else "sequence_length"
    outputs = [vi("logits", TensorProto.FLOAT, ["batch_size", rows, cfg.vocab_size])]
    for i in range(cfg.n_layers):
        for kv in ("key", "value"):
            outputs.append(vi(spec.present(i, kv), elem, _kv_shape(cfg)))
    if spec.attention:
        for i in range(cfg.n_layers):
            outputs.append(vi(spec.attn(i), elem, ["batch_size", cfg.n_heads, "sequence_length",
                                                   "total_sequence_length"]))
    return outputs


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
        for a in [a for a in node.attribute if a.name == "qk_output"]:  # (an optimised graph
            node.attribute.remove(a)  # lists every attribute, its default 0 included)
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

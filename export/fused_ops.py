"""The pieces the fused graph (``export/fused.py``) is built from: a small node/initializer
builder, and the subgraphs that sit outside GroupQueryAttention (positions from the cache
counters, the feed-forward variants, per-head q/k RMSNorm, soft-capping) and the tables it reads
(RoPE cos/sin, sinusoidal positions), the latter computed by the torch model's own functions so
both sides use the same numbers."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvserve.artifact.spec import INPUT_IDS, QUERY_SEQLENS, SEQLENS_K
from kvserve.model.config import ModelConfig

MS = "com.microsoft"


class Builder:
    """Collects nodes and initializers; floating initializers are stored in ``dtype``."""

    def __init__(self, dtype):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.dtype = dtype
        self._n = 0
        self._consts: set[str] = set()

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

    def i64(self, name: str, values) -> str:
        """An int64 constant, stored once however often it is asked for."""
        if name not in self._consts:
            self._consts.add(name)
            self.init(name, np.array(values, np.int64), keep_dtype=True)
        return name


def positions(b: Builder) -> str:
    """position_ids (B, S) int64 from the cache counters: P_b + s, P_b = seqlens_k + 1 - Q_b."""
    one = b.init("const.one_i32", np.array(1, np.int32), keep_dtype=True)
    past = b.one("Sub", [b.one("Add", [SEQLENS_K, one]), QUERY_SEQLENS])  # (B,)
    past = b.one("Cast", [past], to=TensorProto.INT64)
    seq = b.one("Gather", [b.one("Shape", [INPUT_IDS]), b.i64("const.one_i64", 1)], axis=0)
    rng = b.one("Range", [b.i64("const.zero_i64", 0), seq, b.i64("const.step_i64", 1)])  # (S,)
    return b.one("Add", [b.one("Unsqueeze", [past, b.i64("const.axis1", [1])]), rng])  # (B, S)


def ffn(b: Builder, cfg: ModelConfig, h: str, prefix: str, linear) -> str:
    """The feed-forward branch; gated variants split ``w_in``'s output into [gate; up]."""
    up = linear(h, prefix + ".w_in")  # (B, S, F) or (B, S, 2F)
    if cfg.ffn in ("swiglu", "geglu_tanh"):
        gate, val = b.op("Split", [up, b.i64(prefix + ".split", [cfg.d_ff, cfg.d_ff])],
                         n_out=2, axis=-1)
        if cfg.ffn == "swiglu":
            act = b.one("Mul", [gate, b.one("Sigmoid", [gate])])
        else:
            act = b.one("Gelu", [gate], approximate="tanh")
        act = b.one("Mul", [act, val])
    elif cfg.ffn == "gelu":
        act = b.one("Gelu", [up])
    elif cfg.ffn == "gelu_tanh":
        act = b.one("Gelu", [up], approximate="tanh")
    else:
        act = b.one("Relu", [up])
    return linear(act, prefix + ".w_out")


def qk_norm(b: Builder, cfg: ModelConfig, qkv: str, q_weight: str, k_weight: str) -> str:
    """Per-head RMSNorm of q and k in the packed (B, S, (H + 2 Hkv) D) projection (Qwen3).

    GroupQueryAttention's own ``q_norm_weight`` / ``k_norm_weight`` inputs are honoured only by
    the CUDA and WebGPU providers (onnxruntime 1.32), so the norm is a graph op before it."""
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    heads = b.one("Reshape", [qkv, b.i64("const.qkv_heads", [0, 0, H + 2 * Hkv, D])])
    q, k, v = b.op("Split", [heads, b.i64("const.qkv_split", [H, Hkv, Hkv])], n_out=3, axis=2)
    q = b.one("RMSNormalization", [q, q_weight], axis=-1, epsilon=cfg.norm_eps, stash_type=1)
    k = b.one("RMSNormalization", [k, k_weight], axis=-1, epsilon=cfg.norm_eps, stash_type=1)
    joined = b.one("Concat", [q, k, v], axis=2)  # (B, S, H + 2 Hkv, D)
    return b.one("Reshape", [joined, b.i64("const.qkv_packed", [0, 0, -1])])


def softcap(b: Builder, x: str, cap: float, name: str) -> str:
    """cap * tanh(x / cap) (Gemma 2's final-logit soft-capping)."""
    c = b.init(name, np.array(cap, np.float32), keep_dtype=True)
    return b.one("Mul", [b.one("Tanh", [b.one("Div", [x, c])]), c])


def rope_cache(max_len: int, head_dim: int, base: float,
               scaling: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin (max_len, D/2) float32 for GroupQueryAttention's caches: the torch model's own
    tables (``model.layers``, with ``linear`` / ``llama3`` scaling applied to the frequencies),
    so both sides rotate by the same numbers. Not for ``longrope``: its factors depend on the
    sequence, not on the position alone."""
    import torch

    from kvserve.model.layers import rope_cos_sin, rope_inv_freq

    inv = rope_inv_freq(head_dim, base, scaling)
    if len(inv) != 1:
        raise ValueError("rope_cache: one frequency table expected (longrope has two)")
    pos = torch.arange(max_len)[None]  # (1, max_len)
    cos, sin = rope_cos_sin(pos, inv, scaling)  # (1, 1, max_len, D)
    half = head_dim // 2  # rotate-half layout: the two halves repeat
    return cos[0, 0, :, :half].numpy(), sin[0, 0, :, :half].numpy()


def sinusoidal_table(max_len: int, dim: int) -> np.ndarray:
    """PE (max_len, dim) float32: the torch model's table (``model.layers``)."""
    import torch

    from kvserve.model.layers import sinusoidal_table as table

    return table(torch.arange(max_len)[None], dim)[0].numpy()  # (max_len, dim)

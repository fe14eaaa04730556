"""Causal self-attention with multi-head, grouped-query and multi-query heads.

The past K/V are read in place and never concatenated: scores against the past and against the
new rows are computed separately and only the (small) score rows are joined. A decode step
therefore reads the cache once, as attention must, and copies none of it. The layer returns
only the new K/V rows; whoever owns the cache (``model.cache.KVCache`` in torch, the
runtime's preallocated buffers in the server) writes them in.

Options of imported families: per-head RMSNorm of q and k before RoPE (``qk_norm``, Qwen3),
a custom score scale (Gemma 2's ``query_pre_attn_scalar``) and logit soft-capping
``cap * tanh(s / cap)`` before the mask (Gemma 2). Sliding windows and per-layer RoPE are decided
by the caller (``allowed`` and ``rope`` per layer).

Query heads are grouped under their KV head (head h uses KV head h // n_groups), and the
groups are folded into the row dimension, so GQA/MQA never materialise repeated K/V.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .config import ModelConfig
from .layers import apply_rope, make_norm


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_groups = cfg.n_groups
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim)
        self.softcap = cfg.attn_softcap
        self.q_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        q_out = cfg.n_heads * cfg.head_dim
        kv_out = cfg.n_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, q_out + 2 * kv_out, bias=cfg.qkv_bias)
        self.out = nn.Linear(q_out, cfg.d_model, bias=cfg.out_bias)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        allowed: torch.Tensor,  # (B, 1, T, P+T) bool: query t may attend key s
        rope: tuple[torch.Tensor, torch.Tensor] | None,  # cos, sin: (B, 1, T, D)
        past: tuple[torch.Tensor, torch.Tensor] | None,  # (B, Hkv, P, D) each
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        B, T, _ = x.shape
        H, Hkv, D, G = self.n_heads, self.n_kv_heads, self.head_dim, self.n_groups
        # one reshape/transpose for all heads; RoPE rotates queries and keys in one go
        qkv = self.qkv(x).view(B, T, H + 2 * Hkv, D).transpose(1, 2)  # (B, H+2Hkv, T, D)
        if self.q_norm is not None:
            q, k, v = qkv.split((H, Hkv, Hkv), dim=1)  # (B, H|Hkv|Hkv, T, D)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=1)  # (B, H+2Hkv, T, D)
        if rope is not None:
            q, k = apply_rope(qkv[:, :H + Hkv], *rope).split((H, Hkv), dim=1)
            v = qkv[:, H + Hkv:]  # (B, Hkv, T, D)
        else:
            q, k, v = qkv.split((H, Hkv, Hkv), dim=1)  # (B, H|Hkv|Hkv, T, D)

        qg = q.reshape(B, Hkv, G * T, D)  # (B, Hkv, G*T, D): the heads sharing one KV head
        scores = qg @ k.transpose(-1, -2)  # (B, Hkv, G*T, T)
        if past is not None:
            scores_past = qg @ past[0].transpose(-1, -2)  # (B, Hkv, G*T, P)
            scores = torch.cat((scores_past, scores), dim=-1)  # (B, Hkv, G*T, P+T)
        S = scores.shape[-1]
        scores = scores.view(B, H, T, S) * self.scale  # (B, H, T, S)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap  # (B, H, T, S)
        # A large finite negative, not -inf: a row with every key masked stays finite.
        scores = scores.float().masked_fill(~allowed, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)  # (B, H, T, S)

        pg = probs.view(B, Hkv, G * T, S)  # (B, Hkv, G*T, S)
        if past is not None:
            P = S - T
            out = pg[..., :P] @ past[1] + pg[..., P:] @ v  # (B, Hkv, G*T, D)
        else:
            out = pg @ v  # (B, Hkv, G*T, D)
        out = out.view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)  # (B, T, C)
        return self.out(out), (k, v), (probs if need_weights else None)

"""Building blocks: norms, feed-forward variants and position encodings."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig


class RMSNorm(nn.Module):
    """(offset + gamma) * x / sqrt(mean(x^2) + eps), in float32 (as Llama does; Gemma's
    ``(1 + w)`` norm is offset 1)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, float(offset)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim)
        w = self.weight.float()
        if self.offset:
            w = w + self.offset
        # F.rms_norm exports as ONNX RMSNormalization (opset 23): one op instead of seven
        return F.rms_norm(x.float(), (x.shape[-1],), w, self.eps).to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = cfg.d_model if dim is None else dim
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps, cfg.norm_offset)
    return nn.LayerNorm(dim, eps=cfg.norm_eps)


class FeedForward(nn.Module):
    """Position-wise FFN: W_down act(W_up x), or gated W_down (act(W_g x) * W_u x) with silu
    (SwiGLU) or tanh-approximated gelu (GeGLU, Gemma).

    The gate and up projections are one fused matmul (``w_in`` holds [gate; up]).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.ffn
        n_in = 2 * cfg.d_ff if cfg.ffn in ("swiglu", "geglu_tanh") else cfg.d_ff
        self.w_in = nn.Linear(cfg.d_model, n_in, bias=cfg.ffn_bias)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.ffn_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        h = self.w_in(x)  # (B, T, F) or (B, T, 2F)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)  # (B, T, F) each
            h = F.silu(gate) * up
        elif self.kind == "geglu_tanh":
            gate, up = h.chunk(2, dim=-1)  # (B, T, F) each
            h = F.gelu(gate, approximate="tanh") * up
        elif self.kind == "gelu":
            h = F.gelu(h)
        elif self.kind == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        else:
            h = F.relu(h)
        return self.w_out(h)


def sinusoidal_table(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """PE[p, 2i] = sin(p / 10000^(2i/dim)), PE[p, 2i+1] = cos(p / 10000^(2i/dim)).

    positions: (B, T) integer -> (B, T, dim) float32. Computed from the ids, so any length works.
    """
    i2 = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32)  # (dim/2,)
    inv = torch.exp(i2 * (-math.log(10000.0) / dim))  # 1 / 10000^(2i/dim)
    angles = positions.float().unsqueeze(-1) * inv  # (B, T, dim/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (B, T, dim)


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> list[torch.Tensor]:
    """The rotary frequencies (D/2,), as Hugging Face computes them for each rope_type.

    One tensor for plain, ``linear`` and ``llama3`` RoPE; two (short, long) for ``longrope``.
    """
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                          / head_dim))  # (D/2,)
    kind = (scaling or {}).get("type")
    if kind is None:
        return [inv]
    if kind == "linear":
        return [inv / scaling["factor"]]
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return [torch.where(medium, smoothed, scaled)]
    if kind == "longrope":
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return [1.0 / (torch.tensor(scaling[k], dtype=torch.float32) * base ** shape)
                for k in ("short_factor", "long_factor")]
    raise ValueError(f"unknown rope scaling {kind!r}")


def rope_cos_sin(positions: torch.Tensor, inv_freqs: list[torch.Tensor],
                 scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for rotary embeddings in the rotate-half layout (Llama / HF convention).

    positions: (B, T) -> cos, sin: (B, 1, T, head_dim) float32, ready to broadcast over heads.
    ``longrope`` (Phi-3) uses the long factors for a row whose largest position id in the call,
    plus one, exceeds ``original_max_position_embeddings`` (as transformers does per call, here
    per row) and scales cos/sin by its attention factor. Masked columns count: a caller asks
    for the long factors with a masked probe column (``kvserve.artifact.longrope``).
    """
    inv = inv_freqs[0].to(positions.device)  # (D/2,)
    pos = positions.float().unsqueeze(-1)  # (B, T, 1)
    if len(inv_freqs) == 2:
        long_rows = (positions.max(dim=-1, keepdim=True).values + 1
                     > scaling["original_max_position_embeddings"]).unsqueeze(-1)  # (B, 1, 1)
        inv = torch.where(long_rows, inv_freqs[1].to(positions.device), inv)  # (B, 1, D/2)
    freqs = pos * inv  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # (B, 1, T, D)
    cos, sin = emb.cos(), emb.sin()
    factor = (scaling or {}).get("attention_factor")
    if factor is not None and factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) by the position angle. x: (B, H, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, H, T, D)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)

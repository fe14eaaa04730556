"""Building blocks: norms, feed-forward variants and position encodings."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig


class RMSNorm(nn.Module):
    """gamma * x / sqrt(mean(x^2) + eps), computed in float32 (as Llama does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm exports as ONNX RMSNormalization (opset 23): one op instead of seven
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class FeedForward(nn.Module):
    """Position-wise FFN: W_down act(W_up x), or SwiGLU W_down (silu(W_g x) * W_u x).

    SwiGLU's gate and up projections are one fused matmul (``w_in`` holds [gate; up]).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.ffn
        n_in = 2 * cfg.d_ff if cfg.ffn == "swiglu" else cfg.d_ff
        self.w_in = nn.Linear(cfg.d_model, n_in, bias=cfg.ffn_bias)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.ffn_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        h = self.w_in(x)  # (B, T, F) or (B, T, 2F)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)  # (B, T, F) each
            h = F.silu(gate) * up
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


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor,
                                                                                 torch.Tensor]:
    """cos/sin for rotary embeddings in the rotate-half layout (Llama / HF convention).

    positions: (B, T) -> cos, sin: (B, 1, T, head_dim) float32, ready to broadcast over heads.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device,
                                            dtype=torch.float32) / head_dim))  # (D/2,)
    freqs = positions.float().unsqueeze(-1) * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # (B, 1, T, D)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) by the position angle. x: (B, H, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, H, T, D)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)

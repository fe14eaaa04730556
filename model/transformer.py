"""The causal transformer: embeddings -> N blocks -> (final norm) -> logits."""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn as nn

from .attention import Attention
from .config import ModelConfig
from .layers import FeedForward, make_norm, rope_cos_sin, rope_inv_freq, sinusoidal_table

KV = tuple[torch.Tensor, torch.Tensor]  # (B, Hkv, T, D) keys, values


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # (B, T, V)
    present: list[KV]  # per layer: the K/V rows of this call's tokens only, (B, Hkv, T, D)
    attentions: list[torch.Tensor] | None  # per layer (B, H, T, P+T), only when asked


class Block(nn.Module):
    """Pre-Norm: x + f(N(x)); Post-Norm: N(x + f(x)); sandwich (Gemma 2): x + N'(f(N(x))).
    Two residual branches: attention, FFN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre = cfg.norm_placement == "pre"
        self.norm1, self.norm2 = make_norm(cfg), make_norm(cfg)
        # sandwich norms: on the attention and FFN outputs, before the residual add
        self.norm1_post = make_norm(cfg) if cfg.sandwich_norm else None
        self.norm2_post = make_norm(cfg) if cfg.sandwich_norm else None
        self.attn = Attention(cfg)
        self.ffn = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, allowed, rope, past, need_weights):  # x: (B, T, C)
        if self.norm1_post is not None:
            a, kv, w = self.attn(self.norm1(x), allowed, rope, past, need_weights)
            x = x + self.drop(self.norm1_post(a))
            x = x + self.drop(self.norm2_post(self.ffn(self.norm2(x))))
        elif self.pre:
            a, kv, w = self.attn(self.norm1(x), allowed, rope, past, need_weights)
            x = x + self.drop(a)
            x = x + self.drop(self.ffn(self.norm2(x)))
        else:
            a, kv, w = self.attn(x, allowed, rope, past, need_weights)
            x = self.norm1(x + self.drop(a))
            x = self.norm2(x + self.drop(self.ffn(x)))
        return x, kv, w


def attention_allowed(attention_mask: torch.Tensor, T: int) -> torch.Tensor:
    """Causal + padding mask. attention_mask: (B, S) with 1 = real token over past+new keys.

    Returns (B, 1, T, S) bool: the query at absolute index S-T+t may see key s when s <= S-T+t
    and key s is real.
    """
    S = attention_mask.shape[-1]
    q_idx = torch.arange(T, device=attention_mask.device).unsqueeze(1) + (S - T)  # (T, 1)
    k_idx = torch.arange(S, device=attention_mask.device).unsqueeze(0)  # (1, S)
    causal = k_idx <= q_idx  # (T, S)
    return causal.unsqueeze(0).unsqueeze(0) & attention_mask.bool()[:, None, None, :]


def window_allowed(allowed: torch.Tensor, attention_mask: torch.Tensor,
                   window: int) -> torch.Tensor:
    """``allowed`` (B, 1, T, S) further limited to keys fewer than ``window`` real tokens back
    (the query itself included), as Mistral / Qwen2 / Gemma 2 sliding windows.

    Distances count real tokens (rank = cumsum(mask) - 1), so holes in the key rows (the
    server's buffers, left padding) do not shrink the window.
    """
    T = allowed.shape[2]
    rank = attention_mask.long().cumsum(-1) - 1  # (B, S)
    q_rank = rank[:, -T:]  # (B, T)
    near = rank[:, None, :] > q_rank[:, :, None] - window  # (B, T, S)
    return allowed & near.unsqueeze(1)  # (B, 1, T, S)


def default_position_ids(attention_mask: torch.Tensor, T: int) -> torch.Tensor:
    """Positions count real tokens only (left padding): cumsum(mask) - 1, pads at 0. (B, T)."""
    pos = attention_mask.long().cumsum(-1) - 1  # (B, S)
    return pos[:, -T:].clamp(min=0)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positions == "learned" \
            else None
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = make_norm(cfg) if cfg.final_norm else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self._inv_freqs = rope_inv_freq(cfg.head_dim, cfg.rope_base, cfg.rope_scaling) \
            if cfg.positions == "rope" else []
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:  # norm gains start at 1 (offset norms at 0), biases at 0
                gain = "norm" in name and name.endswith("weight") and not self.cfg.norm_offset
                nn.init.ones_(p) if gain else nn.init.zeros_(p)
            elif name.endswith("attn.out.weight") or name.endswith("ffn.w_out.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layers))  # GPT-2 scaling
            else:
                nn.init.normal_(p, 0.0, std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        attention_mask: torch.Tensor | None = None,  # (B, P+T), 1 = real token
        position_ids: torch.Tensor | None = None,  # (B, T)
        past: Sequence[KV] | None = None,  # per layer (B, Hkv, P, D)
        output_attentions: bool = False,
    ) -> ModelOutput:
        B, T = input_ids.shape
        P = past[0][0].shape[2] if past is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, P + T, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, T)
        allowed = attention_allowed(attention_mask, T)  # (B, 1, T, P+T)

        cfg = self.cfg
        x = self.tok_emb(input_ids)  # (B, T, C)
        if cfg.embed_scale is not None:
            x = x * cfg.embed_scale
        rope = None
        if cfg.positions == "learned":
            x = x + self.pos_emb(position_ids)
        elif cfg.positions == "sinusoidal":
            x = x + sinusoidal_table(position_ids, cfg.d_model).to(x.dtype)
        elif cfg.positions == "rope":
            rope = rope_cos_sin(position_ids, self._inv_freqs, cfg.rope_scaling)
        x = self.drop(x)
        windowed = {w: window_allowed(allowed, attention_mask, w)
                    for w in {cfg.layer_window(i) for i in range(cfg.n_layers)} - {None}}

        present: list[KV] = []
        attentions: list[torch.Tensor] | None = [] if output_attentions else None
        for i, layer in enumerate(self.layers):
            w_i = cfg.layer_window(i)
            x, kv, w = layer(x, allowed if w_i is None else windowed[w_i],
                             rope if cfg.layer_rope(i) else None,
                             past[i] if past is not None else None, output_attentions)
            present.append(kv)
            if attentions is not None:
                attentions.append(w)
        if self.norm_f is not None:
            x = self.norm_f(x)
        logits = self.lm_head(x)  # (B, T, V)
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return ModelOutput(logits, present, attentions)

"""The causal transformer: embeddings -> N blocks -> (final norm) -> logits."""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn as nn

from .attention import Attention
from .config import ModelConfig
from .layers import FeedForward, make_norm, rope_cos_sin, sinusoidal_table

KV = tuple[torch.Tensor, torch.Tensor]  # (B, Hkv, T, D) keys, values


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # (B, T, V)
    present: list[KV]  # per layer: the K/V rows of this call's tokens only, (B, Hkv, T, D)
    attentions: list[torch.Tensor] | None  # per layer (B, H, T, P+T), only when asked


class Block(nn.Module):
    """Pre-Norm: x + f(N(x)); Post-Norm: N(x + f(x)). Two residual branches: attention, FFN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre = cfg.norm_placement == "pre"
        self.norm1, self.norm2 = make_norm(cfg), make_norm(cfg)
        self.attn = Attention(cfg)
        self.ffn = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, allowed, rope, past, need_weights):  # x: (B, T, C)
        if self.pre:
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
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:  # norm gains start at 1, biases at 0
                nn.init.ones_(p) if "norm" in name and name.endswith("weight") else nn.init.zeros_(p)
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

        x = self.tok_emb(input_ids)  # (B, T, C)
        rope = None
        if self.cfg.positions == "learned":
            x = x + self.pos_emb(position_ids)
        elif self.cfg.positions == "sinusoidal":
            x = x + sinusoidal_table(position_ids, self.cfg.d_model).to(x.dtype)
        elif self.cfg.positions == "rope":
            rope = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_base)
        x = self.drop(x)

        present: list[KV] = []
        attentions: list[torch.Tensor] | None = [] if output_attentions else None
        for i, layer in enumerate(self.layers):
            x, kv, w = layer(x, allowed, rope, past[i] if past is not None else None,
                             output_attentions)
            present.append(kv)
            if attentions is not None:
                attentions.append(w)
        if self.norm_f is not None:
            x = self.norm_f(x)
        return ModelOutput(self.lm_head(x), present, attentions)  # logits (B, T, V)

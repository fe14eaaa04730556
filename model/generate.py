"""Reference generation in torch: prefill once, then one decode step per token.

This is the ground truth the exported graphs and the server are tested against; sampling uses
the same pure functions as the server (``model.sampling``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .cache import KVCache
from .sampling import SamplingParams, next_token, request_seed
from .transformer import ModelOutput, Transformer, default_position_ids


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """-> input_ids (B, T), attention_mask (B, T), prompts aligned to the right."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for b, p in enumerate(prompts):
        if len(p):
            ids[b, T - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[b, T - len(p):] = 1
    return ids, mask


@torch.no_grad()
def prefill(model: Transformer, ids: torch.Tensor, mask: torch.Tensor, cache: KVCache,
            output_attentions: bool = False) -> ModelOutput:
    out = model(ids, mask, output_attentions=output_attentions)  # logits (B, T, V)
    cache.append(out.present)
    return out


@torch.no_grad()
def decode(model: Transformer, tokens: torch.Tensor, mask: torch.Tensor, cache: KVCache,
           output_attentions: bool = False) -> ModelOutput:
    """tokens: (B, 1); mask: (B, P+1) covering the cache and the new token."""
    out = model(tokens, mask, past=cache.past(), output_attentions=output_attentions)
    cache.append(out.present)
    return out


@torch.no_grad()
def refill_longrope(model: Transformer, hist: torch.Tensor, mask: torch.Tensor,
                    cache: KVCache) -> None:
    """LongRoPE: rows whose next token is the first past ``original_max_position_embeddings``
    have their cached rows recomputed with the long factors, as transformers' ``generate``
    recomputes a sequence there (``kvserve.artifact.longrope`` explains; the runtime does the
    same with ``LongRopeSwitch``). hist: (B, P) the cached ids (left-padded); mask: (B, P)
    their attention mask. A masked probe column at position ``limit`` selects the long
    factors (the decision is per row, from its largest position id)."""
    limit = model.cfg.longrope_limit
    P = hist.shape[1]
    for b in torch.nonzero(mask.sum(-1) == limit).flatten().tolist():
        ids = torch.cat([hist[b:b + 1], hist.new_zeros(1, 1)], 1)  # (1, P + 1)
        m = torch.cat([mask[b:b + 1], mask.new_zeros(1, 1)], 1)
        pos = torch.cat([default_position_ids(mask[b:b + 1], P), torch.tensor([[limit]])], 1)
        out = model(ids, m, position_ids=pos)
        for layer, (k, v) in zip(cache.layers, out.present):  # (1, Hkv, P + 1, D)
            layer.k[b, :, :P] = k[0, :, :P]
            layer.v[b, :, :P] = v[0, :, :P]


@dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per row (stops included when eos)
    logits: list[list[np.ndarray]] = field(default_factory=list)  # per row, per step (V,)


@torch.no_grad()
def generate(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             params: SamplingParams = SamplingParams(), eos_id: int | None = None,
             keep_logits: bool = False) -> Generation:
    """Left-padded batch generation. Each row stops at eos (kept) or after max_new_tokens."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    B = len(prompts)
    ids, mask = left_pad(prompts, model.cfg.pad_token_id or 0)
    cache = KVCache(model.cfg, B, capacity=ids.shape[1] + max_new_tokens,
                    dtype=next(model.parameters()).dtype)
    seeds = [request_seed(params.seed) if not params.greedy else None for _ in range(B)]
    out_tokens: list[list[int]] = [[] for _ in range(B)]
    out_logits: list[list[np.ndarray]] = [[] for _ in range(B)]
    done = [False] * B
    logits = prefill(model, ids, mask, cache).logits[:, -1].float().numpy()  # (B, V)
    longrope, hist = model.cfg.longrope_limit is not None, ids  # hist: the cached ids
    for step in range(max_new_tokens):
        nxt = []
        for b in range(B):
            if done[b]:
                nxt.append(model.cfg.pad_token_id or 0)
                continue
            if keep_logits:
                out_logits[b].append(logits[b].copy())
            gen = np.asarray(out_tokens[b], dtype=np.int64)
            ctx = np.concatenate([np.asarray(prompts[b], dtype=np.int64), gen])
            t = next_token(logits[b], params, seeds[b], len(gen), ctx, gen)
            out_tokens[b].append(t)
            done[b] = (eos_id is not None and t == eos_id)
            nxt.append(t)
        if all(done) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], dim=1)  # (B, P+1)
        tok = torch.tensor(nxt, dtype=torch.long).unsqueeze(1)  # (B, 1)
        if longrope:
            refill_longrope(model, hist, mask[:, :-1], cache)
            hist = torch.cat([hist, tok], 1)
        logits = decode(model, tok, mask, cache).logits[:, -1].float().numpy()  # (B, V)
    return Generation(out_tokens, out_logits if keep_logits else [])

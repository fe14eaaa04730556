"""Torch modules with the flat signatures of the exported graphs (one per GraphSpec)."""
from __future__ import annotations

import torch
import torch.nn as nn

from kvserve.model.transformer import Transformer

from kvserve.artifact.spec import GraphSpec


class GraphModule(nn.Module):
    """forward(input_ids, attention_mask, position_ids, *past) -> (logits, *present, *attn).

    ``past`` is flat: layer i's key at 2i, value at 2i+1, each (B, Hkv, P, D).
    """

    def __init__(self, model: Transformer, spec: GraphSpec):
        super().__init__()
        self.model, self.spec = model, spec

    def forward(self, input_ids, attention_mask, position_ids, *past):
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)] \
            if self.spec.with_past else None
        out = self.model(input_ids, attention_mask, position_ids, past=pairs,
                         output_attentions=self.spec.with_attention)
        flat = [t for kv in out.present for t in kv]  # 2L x (B, Hkv, T, D)
        attn = [a.float() for a in out.attentions] if self.spec.with_attention else []
        return (out.logits.float(), *flat, *attn)  # logits (B, T, V)


def example_inputs(model: Transformer, spec: GraphSpec) -> tuple[torch.Tensor, ...]:
    """Shapes chosen so that no dynamic dimension is 0 or 1 in the example (torch.export
    specialises those): batch 2, sequence 3 (2 with a past), past 4."""
    cfg = model.cfg
    dtype = next(model.parameters()).dtype
    B, P = 2, 4
    T = 2 if spec.with_past else 3
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    mask = torch.ones(B, P + T if spec.with_past else T, dtype=torch.long)
    mask[0, 0] = 0  # a left-padded row
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -T:]
    past = []
    if spec.with_past:
        past = [torch.randn(B, cfg.n_kv_heads, P, cfg.head_dim, dtype=dtype)
                for _ in range(2 * cfg.n_layers)]
    return (ids, mask, pos, *past)


def dynamic_shapes(model: Transformer, spec: GraphSpec):
    Dim = torch.export.Dim
    batch = Dim("batch_size", min=1, max=4096)
    if spec.with_past:
        past = Dim("past_sequence_length", min=1, max=1 << 20)
        seq = Dim("sequence_length", min=1, max=1 << 20)
        return {
            "input_ids": {0: batch, 1: seq},
            "attention_mask": {0: batch, 1: Dim.DYNAMIC},  # = past + seq, inferred
            "position_ids": {0: batch, 1: seq},
            "past": tuple({0: batch, 2: past} for _ in range(2 * model.cfg.n_layers)),
        }
    seq = Dim("sequence_length", min=1, max=1 << 20)
    return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq},
            "position_ids": {0: batch, 1: seq}}

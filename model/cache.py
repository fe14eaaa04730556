"""The torch KV cache: one preallocated home per layer; new rows are written in place."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .transformer import KV


class LayerKV:
    """Keys and values of one layer: (B, Hkv, capacity, D) buffers, valid up to ``length``."""

    def __init__(self, batch: int, cfg: ModelConfig, capacity: int, dtype, device):
        shape = (batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, C, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, C, D)

    def view(self, length: int) -> KV:
        return self.k[:, :, :length], self.v[:, :, :length]  # (B, Hkv, L, D) views, no copy

    def write(self, start: int, kv: KV) -> None:
        k, v = kv  # (B, Hkv, T, D)
        T = k.shape[2]
        self.k[:, :, start:start + T] = k
        self.v[:, :, start:start + T] = v


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, capacity: int | None = None,
                 dtype=torch.float32, device="cpu"):
        self.capacity = capacity or cfg.max_seq_len
        self.layers = [LayerKV(batch, cfg, self.capacity, dtype, device)
                       for _ in range(cfg.n_layers)]
        self.length = 0

    def past(self) -> list[KV] | None:
        if self.length == 0:
            return None
        return [layer.view(self.length) for layer in self.layers]

    def append(self, present: list[KV]) -> None:
        T = present[0][0].shape[2]
        if self.length + T > self.capacity:
            raise ValueError(f"KV cache full: {self.length} + {T} > capacity {self.capacity}")
        for layer, kv in zip(self.layers, present):
            layer.write(self.length, kv)
        self.length += T

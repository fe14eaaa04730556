"""The one config that drives the model: a dataclass with presets, saved with every checkpoint.

No torch import here: the server reads the same config from an artifact's ``config.json``.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POSITIONS = ("learned", "sinusoidal", "rope", "none")
NORMS = ("layernorm", "rmsnorm")
PLACEMENTS = ("pre", "post")
FFNS = ("gelu", "gelu_tanh", "relu", "swiglu", "geglu_tanh")
GATED_FFNS = ("swiglu", "geglu_tanh")  # act(W_gate x) * W_up x
# RoPE scaling kinds (Hugging Face's rope_type names) and the keys each needs
ROPE_SCALING = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings",
                 "attention_factor"),
}


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None = n_heads (MHA); 1 = MQA; in between = GQA
    d_ff: int | None = None  # None = 4*d_model (gelu/relu) or the Llama 8/3 rule (swiglu)
    max_seq_len: int = 1024
    positions: str = "rope"  # learned | sinusoidal | rope | none
    rope_base: float = 10000.0
    norm: str = "rmsnorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    norm_placement: str = "pre"  # pre | post
    final_norm: bool = True
    ffn: str = "swiglu"  # gelu | gelu_tanh | relu | swiglu | geglu_tanh
    qkv_bias: bool = False
    out_bias: bool = False
    ffn_bias: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # --- options of imported families; every default is the behaviour of older checkpoints ---
    explicit_head_dim: int | None = None  # None = d_model // n_heads (Qwen3, Gemma: explicit)
    # {"type": linear|llama3|longrope, ...ROPE_SCALING keys}; None = plain RoPE
    rope_scaling: dict[str, Any] | None = None
    rope_layers: list[bool] | None = None  # per layer: apply RoPE (SmolLM3); None = all
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    embed_scale: float | None = None  # token embeddings times this (Gemma: sqrt(d_model))
    norm_offset: float = 0.0  # RMSNorm gain is (offset + weight) (Gemma: 1)
    sandwich_norm: bool = False  # pre-norm plus a norm on each branch's output (Gemma 2)
    attn_scale: float | None = None  # scores times this; None = 1/sqrt(head_dim)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    sliding_window: int | None = None  # keys within this many positions (self included)
    sliding_layers: list[bool] | None = None  # per layer: windowed; None = all (if a window)
    eos_token_ids: list[int] | None = None  # every id that ends generation (Llama 3: three)
    extra: dict[str, Any] = field(default_factory=dict)  # provenance (e.g. imported-from)

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_ff is None:
            if self.ffn in GATED_FFNS:  # Llama: 2/3 of 4d, rounded up to a multiple of 64
                self.d_ff = 64 * ((int(8 * self.d_model / 3) + 63) // 64)
            else:
                self.d_ff = 4 * self.d_model
        self.validate()

    # --- derived -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        if self.explicit_head_dim is not None:
            return self.explicit_head_dim
        return self.d_model // self.n_heads

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i`` (None = full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is not None and not self.sliding_layers[i]:
            return None
        return self.sliding_window

    def layer_rope(self, i: int) -> bool:
        return self.positions == "rope" and (self.rope_layers is None or self.rope_layers[i])

    @property
    def longrope_limit(self) -> int | None:
        """LongRoPE's ``original_max_position_embeddings`` (a row with more tokens uses the long
        factors, see ``kvserve.artifact.longrope``); None for every other model."""
        rs = self.rope_scaling
        if self.positions == "rope" and rs and rs.get("type") == "longrope":
            return int(rs["original_max_position_embeddings"])
        return None

    @property
    def stop_ids(self) -> list[int]:
        """Every EOS id: ``eos_token_ids`` when given, else ``[eos_token_id]`` (or none)."""
        if self.eos_token_ids:
            return list(self.eos_token_ids)
        return [] if self.eos_token_id is None else [self.eos_token_id]

    @property
    def n_groups(self) -> int:
        """Query heads per KV head (1 = MHA, n_heads = MQA)."""
        return self.n_heads // self.n_kv_heads

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid model config: {msg}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
        if self.explicit_head_dim is None:
            need(self.d_model % self.n_heads == 0,
                 f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        else:
            need(isinstance(self.explicit_head_dim, int) and 0 < self.explicit_head_dim <= 4096,
                 "explicit_head_dim must be a positive integer <= 4096")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        need(self.positions in POSITIONS, f"positions must be one of {POSITIONS}")
        need(self.norm in NORMS, f"norm must be one of {NORMS}")
        need(self.norm_placement in PLACEMENTS, f"norm_placement must be one of {PLACEMENTS}")
        need(self.ffn in FFNS, f"ffn must be one of {FFNS}")
        need(self.positions != "rope" or self.head_dim % 2 == 0, "RoPE needs an even head_dim")
        need(self.positions != "sinusoidal" or self.d_model % 2 == 0,
             "sinusoidal positions need an even d_model")
        need(self.rope_base > 1.0, "rope_base must be > 1")
        need(0.0 < self.norm_eps < 1.0, "norm_eps must be in (0, 1)")
        need(0.0 <= self.dropout < 1.0, "dropout must be in [0, 1)")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            need(v is None or 0 <= v < self.vocab_size, f"{name} must be in [0, vocab_size)")
        self._validate_options(need)

    def _validate_options(self, need) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            need(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                               and 0 < v < 1e9), f"{name} must be None or a positive number")

        for name in ("embed_scale", "attn_scale", "attn_softcap", "final_softcap"):
            positive(name)
        need(isinstance(self.norm_offset, (int, float)) and abs(self.norm_offset) <= 1.0,
             "norm_offset must be a number in [-1, 1]")
        need(not (self.qk_norm or self.norm_offset) or self.norm == "rmsnorm",
             "qk_norm and norm_offset need norm=rmsnorm")
        need(not self.sandwich_norm or self.norm_placement == "pre",
             "sandwich_norm needs norm_placement=pre")
        need(self.sliding_window is None or (isinstance(self.sliding_window, int)
                                             and 0 < self.sliding_window <= 1 << 24),
             "sliding_window must be None or a positive integer")
        for name in ("sliding_layers", "rope_layers"):
            v = getattr(self, name)
            need(v is None or (isinstance(v, list) and len(v) == self.n_layers
                               and all(isinstance(b, bool) for b in v)),
                 f"{name} must be None or one bool per layer")
        need(self.eos_token_ids is None or (
            isinstance(self.eos_token_ids, list) and 0 < len(self.eos_token_ids) <= 64
            and all(isinstance(i, int) and 0 <= i < self.vocab_size
                    for i in self.eos_token_ids)),
             "eos_token_ids must be None or 1..64 ids in [0, vocab_size)")
        rs = self.rope_scaling
        if rs is not None:
            need(isinstance(rs, dict) and rs.get("type") in ROPE_SCALING,
                 f"rope_scaling type must be one of {sorted(ROPE_SCALING)}")
            need(self.positions == "rope", "rope_scaling needs positions=rope")
            missing = [k for k in ROPE_SCALING[rs["type"]] if k not in rs]
            need(not missing, f"rope_scaling {rs['type']} needs {missing}")
            unknown = sorted(set(rs) - {"type", *ROPE_SCALING[rs["type"]]})
            need(not unknown, f"rope_scaling {rs['type']}: unknown keys {unknown}")
            if rs["type"] == "longrope":
                for k in ("short_factor", "long_factor"):
                    need(isinstance(rs[k], list) and len(rs[k]) == self.head_dim // 2,
                         f"rope_scaling longrope {k} needs head_dim/2 numbers")

    # --- persistence -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {unknown}")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def replace(self, **changes: Any) -> "ModelConfig":
        return ModelConfig.from_dict({**self.to_dict(), **changes})


PRESETS: dict[str, dict[str, Any]] = {
    # tests: trains in seconds
    "tiny": dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192,
                 max_seq_len=256),
    # the default: a few million parameters, useful after minutes on 2 cores
    "small": dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=768,
                  max_seq_len=1024),
    # the benchmark sizes of ../shared/NOTES.md (Llama architecture)
    "bench-6m": dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2,
                     d_ff=704, max_seq_len=2048),
    "bench-100m": dict(vocab_size=16384, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
                       d_ff=2048, max_seq_len=2048),
    # shapes that hold real checkpoints
    "gpt2": dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
                 max_seq_len=1024, positions="learned", norm="layernorm", norm_eps=1e-5,
                 ffn="gelu_tanh", qkv_bias=True, out_bias=True, ffn_bias=True,
                 tie_embeddings=True, bos_token_id=50256, eos_token_id=50256),
    "llama-1b": dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                     d_ff=5632, max_seq_len=2048, positions="rope", rope_base=10000.0,
                     norm="rmsnorm", norm_eps=1e-5, ffn="swiglu", tie_embeddings=False,
                     bos_token_id=1, eos_token_id=2),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})

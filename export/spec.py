"""What each exported graph is: names, shapes and dtypes of its inputs and outputs.

The conventions follow onnxruntime-genai / optimum (see ``../shared/NOTES.md``) with one
documented difference: ``present.{i}.key/value`` hold only the rows of the tokens fed in this
call (prefill: the prompt; decode: the new token, or a chunk of new tokens when a long prompt is
fed in pieces), never ``concat(past, new)``. The runtime writes them into its preallocated
per-sequence buffer, so a decode step copies no cache.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.model.config import ModelConfig

OPSET = 23  # RMSNormalization is one op from 23 (onnxruntime >= 1.22)
PRESENT_LAYOUT = "new_rows"  # present.* = K/V of this call's tokens only


@dataclass(frozen=True)
class GraphSpec:
    name: str  # file stem: prefill, decode, prefill_attn, decode_attn
    with_past: bool
    with_attention: bool

    @property
    def filename(self) -> str:
        return f"{self.name}.onnx"

    def input_names(self, cfg: ModelConfig) -> list[str]:
        names = ["input_ids", "attention_mask", "position_ids"]
        if self.with_past:
            names += past_names(cfg)
        return names

    def output_names(self, cfg: ModelConfig) -> list[str]:
        names = ["logits"] + present_names(cfg)
        if self.with_attention:
            names += [f"attn_weights.{i}" for i in range(cfg.n_layers)]
        return names

    def io_shapes(self, cfg: ModelConfig) -> dict[str, dict]:
        """name -> {"dtype", "shape"} with symbolic dims, for the manifest and the runtime."""
        seq = "sequence_length"  # decode: 1 new token per step, or a chunk of a long prompt
        total = "total_sequence_length"
        kv = lambda t: ["batch_size", cfg.n_kv_heads, t, cfg.head_dim]  # noqa: E731
        io: dict[str, dict] = {
            "input_ids": {"dtype": "int64", "shape": ["batch_size", seq]},
            "attention_mask": {"dtype": "int64", "shape": ["batch_size", total]},
            "position_ids": {"dtype": "int64", "shape": ["batch_size", seq]},
        }
        if self.with_past:
            for n in past_names(cfg):
                io[n] = {"dtype": "float32", "shape": kv("past_sequence_length")}
        io["logits"] = {"dtype": "float32", "shape": ["batch_size", seq, cfg.vocab_size]}
        for n in present_names(cfg):
            io[n] = {"dtype": "float32", "shape": kv(seq)}
        if self.with_attention:
            for i in range(cfg.n_layers):
                io[f"attn_weights.{i}"] = {"dtype": "float32",
                                           "shape": ["batch_size", cfg.n_heads, seq, total]}
        return io


PREFILL = GraphSpec("prefill", with_past=False, with_attention=False)
DECODE = GraphSpec("decode", with_past=True, with_attention=False)
PREFILL_ATTN = GraphSpec("prefill_attn", with_past=False, with_attention=True)
DECODE_ATTN = GraphSpec("decode_attn", with_past=True, with_attention=True)
ALL_SPECS = (PREFILL, DECODE, PREFILL_ATTN, DECODE_ATTN)


def past_names(cfg: ModelConfig) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(cfg.n_layers) for kv in ("key", "value")]


def present_names(cfg: ModelConfig) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(cfg.n_layers) for kv in ("key", "value")]

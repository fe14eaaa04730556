"""What each exported graph is: names, shapes and dtypes of its inputs and outputs, written
once. Export writes it into the manifest (``graphs`` and ``runtime``, as onnxruntime-genai's
``genai_config.json``); the runtime reads the names back from there.

Two kinds of artifact:
- **fused** (the default): one graph for prefill and decode on
  ``com.microsoft.GroupQueryAttention``, the KV cache one shared past/present buffer per layer
  that the op writes in place (``FusedSpec``; ``export/fused.py`` builds it).
- **portable** (``kvserve export --portable``): standard ONNX ops only, prefill and decode
  graphs (``GraphSpec`` below).

The portable conventions follow onnxruntime-genai / optimum (see ``../shared/NOTES.md``) with one
documented difference: ``present.{i}.key/value`` hold only the rows of the tokens fed in this
call (prefill: the prompt; decode: the new token, or a chunk of new tokens when a long prompt is
fed in pieces), never ``concat(past, new)``. The runtime writes them into its preallocated
per-sequence buffer, so a decode step copies no cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.model.config import ModelConfig

OPSET = 23  # RMSNormalization is one op from 23 (onnxruntime >= 1.22); both kinds of graph
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


# --- the fused kind ----------------------------------------------------------------------------
# the fused graph's small inputs (GroupQueryAttention's names), typed here only
INPUT_IDS = "input_ids"  # (B, S) int64, right-padded
SEQLENS_K = "seqlens_k"  # (B,) int32: tokens in the cache after this call - 1
QUERY_SEQLENS = "query_seqlens"  # (B,) int32: valid tokens of this call
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"  # () int32: max over the batch of seqlens_k + 1
# (+ 1 in a paired graph, ``FusedSpec.paired``: its extra row)
LOGITS_ROWS = "logits_rows"  # (B, R) int64: the positions of each row that get logits
# tables with a row per position (initializers): the graph serves no position past their rows
ROPE_COS, ROPE_SIN = "rope.cos", "rope.sin"  # (max_seq_len, D / 2): GroupQueryAttention's
POSITION_TABLE = "pos_emb.table"  # (max_seq_len, C): learned or sinusoidal positions
PORTABLE_POSITION_TABLE = "model.pos_emb.weight"  # the portable graphs' learned positions
# (the torch module's name; a portable graph computes RoPE and sinusoidal rows from positions)
POSITION_TABLES = (ROPE_COS, ROPE_SIN, POSITION_TABLE, PORTABLE_POSITION_TABLE)

FUSED = "fused"
PORTABLE = "portable"
KINDS = (FUSED, PORTABLE)
FUSED_LAYOUT = "shared_buffer"  # past and present are one (B, Hkv, capacity, D) buffer


@dataclass(frozen=True)
class FusedSpec:
    """Names of the fused graph's I/O; ``%d`` is the layer. ``attention``: the diagnostics
    variant (GroupQueryAttention's ``qk_output``: probabilities per layer). ``logits_rows``:
    the input (B, R) naming which of each row's S positions get logits (R of them, in that
    order): a prefill asks for its last row only, Score for all; None in artifacts exported
    before it existed (their logits are (B, S, V), every position). ``paired``: each
    GroupQueryAttention gets one more query row per row than the call feeds, one position
    past the row's last (a shorter, right-padded row's first padding position; for the
    longest rows a copy of their last; its K/V row lands past the slot's rows, never read),
    so that every row takes the op's multi-token path and a token's row comes out the same,
    bit for bit, from a one-token step, a verification or any prefill split (the op's
    one-token path rounds differently; quantized activations magnify that to ~1e-2 of the
    logits); the runtime keeps one spare KV row per slot and feeds ``total_sequence_length``
    counting the extra row (a host input of the op, on CUDA too)."""
    attention: bool = False
    logits_rows: str | None = LOGITS_ROWS
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"
    attn_weights: str = "attn_weights.%d"
    paired: bool = False

    @property
    def filename(self) -> str:
        return "model_attn.onnx" if self.attention else "model.onnx"

    @property
    def name(self) -> str:
        return "model_attn" if self.attention else "model"

    def past(self, i: int, kv: str) -> str:
        return (self.past_key if kv == "key" else self.past_value) % i

    def present(self, i: int, kv: str) -> str:
        return (self.present_key if kv == "key" else self.present_value) % i

    def attn(self, i: int) -> str:
        return self.attn_weights % i

    def input_names(self, cfg: ModelConfig) -> list[str]:
        return [*FUSED_SMALL_INPUTS, *([self.logits_rows] if self.logits_rows else [])] + [
            self.past(i, kv) for i in range(cfg.n_layers) for kv in ("key", "value")]

    def output_names(self, cfg: ModelConfig) -> list[str]:
        names = ["logits"] + [self.present(i, kv) for i in range(cfg.n_layers)
                              for kv in ("key", "value")]
        if self.attention:
            names += [self.attn(i) for i in range(cfg.n_layers)]
        return names

    def io_shapes(self, cfg: ModelConfig, kv_dtype: str = "float32") -> dict[str, dict]:
        kv = ["batch_size", cfg.n_kv_heads, "max_cache_length", cfg.head_dim]
        io: dict[str, dict] = {
            INPUT_IDS: {"dtype": "int64", "shape": ["batch_size", "sequence_length"]},
            SEQLENS_K: {"dtype": "int32", "shape": ["batch_size"]},
            QUERY_SEQLENS: {"dtype": "int32", "shape": ["batch_size"]},
            TOTAL_SEQUENCE_LENGTH: {"dtype": "int32", "shape": []},
        }
        rows = "sequence_length"
        if self.logits_rows:
            rows = "logits_rows"
            io[self.logits_rows] = {"dtype": "int64", "shape": ["batch_size", rows]}
        for i in range(cfg.n_layers):
            for k in ("key", "value"):
                io[self.past(i, k)] = {"dtype": kv_dtype, "shape": kv}
        io["logits"] = {"dtype": "float32", "shape": ["batch_size", rows, cfg.vocab_size]}
        for i in range(cfg.n_layers):
            for k in ("key", "value"):
                io[self.present(i, k)] = {"dtype": kv_dtype, "shape": kv}
        if self.attention:
            for i in range(cfg.n_layers):
                io[self.attn(i)] = {"dtype": "float32", "shape": [
                    "batch_size", cfg.n_heads, "sequence_length", "total_sequence_length"]}
        return io


# inputs every fused call feeds (per step: a few ints per row); the rest are the KV buffers
FUSED_SMALL_INPUTS = (INPUT_IDS, SEQLENS_K, QUERY_SEQLENS, TOTAL_SEQUENCE_LENGTH)
# inputs that GroupQueryAttention reads on the host even on the CUDA provider: bound in CPU
# memory there (binding them on the device would copy them to the host at bind time)
FUSED_HOST_INPUTS = (TOTAL_SEQUENCE_LENGTH,)


def runtime_section(kind: str, cfg: ModelConfig, graphs: dict[str, str],
                    kv_dtype: str = "float32", paired: bool = False) -> dict[str, Any]:
    """The manifest's ``runtime`` entry: what the runtime needs to drive the graphs."""
    spec = FusedSpec()
    if kind == FUSED:
        names = {"past_key": spec.past_key, "past_value": spec.past_value,
                 "present_key": spec.present_key, "present_value": spec.present_value,
                 "attn_weights": spec.attn_weights}
        layout = FUSED_LAYOUT
    else:
        names = {"past_key": "past_key_values.%d.key", "past_value": "past_key_values.%d.value",
                 "present_key": "present.%d.key", "present_value": "present.%d.value",
                 "attn_weights": "attn_weights.%d"}
        layout = PRESENT_LAYOUT
    return {"kind": kind, "graphs": graphs, "names": names,
            **({"logits_rows": spec.logits_rows} if kind == FUSED else {}),
            **({"paired_attention": True} if kind == FUSED and paired else {}),
            "host_inputs": list(FUSED_HOST_INPUTS) if kind == FUSED else [],
            "kv": {"layout": layout, "dtype": kv_dtype, "num_layers": cfg.n_layers,
                   "num_kv_heads": cfg.n_kv_heads, "head_size": cfg.head_dim},
            "past_present_share_buffer": kind == FUSED}


def fused_spec_from(runtime: dict[str, Any], attention: bool) -> FusedSpec:
    """The FusedSpec a manifest's ``runtime`` entry describes (names read, not retyped)."""
    n = runtime["names"]
    return FusedSpec(attention=attention, past_key=n["past_key"], past_value=n["past_value"],
                     present_key=n["present_key"], present_value=n["present_value"],
                     attn_weights=n["attn_weights"], logits_rows=runtime.get("logits_rows"),
                     paired=bool(runtime.get("paired_attention")))

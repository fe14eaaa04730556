"""Phi-3 / Phi-3.5: the Llama layout with fused qkv_proj and gate_up_proj, sliding_window on
every layer, and LongRoPE (``longrope``, formerly ``su``) in the long-context variants."""
from __future__ import annotations

from typing import Any

from kvserve.model.config import ModelConfig

from ..hf_support import family_rows
from .common import LLAMA_KEYS, Support, get_int, layer_windows
from .llama import base_config, llama_state

PREFIX = "model."
SUPPORTED = family_rows("phi3")
KEYS = {"phi3": LLAMA_KEYS | {"sliding_window", "original_max_position_embeddings",
                              "resid_pdrop", "embd_pdrop"}}


# Phi3Config's default: transformers uses it (and overrides rope_scaling's value) when a
# config.json has no top-level original_max_position_embeddings
ORIGINAL_MAX_DEFAULT = 4096


def config(hf: dict[str, Any], s: Support, extra: dict[str, Any]) -> ModelConfig:
    arch = s.architecture
    if hf.get("original_max_position_embeddings") is None:
        hf = {**hf, "original_max_position_embeddings": ORIGINAL_MAX_DEFAULT}
    n_layers = get_int(hf, "num_hidden_layers", arch)
    window, layers = layer_windows(hf, arch, n_layers, hf.get("sliding_window"),
                                   ["sliding_attention"] * n_layers)
    return base_config(hf, arch, sliding_window=window, sliding_layers=layers, extra=extra,
                       eps_default=1e-5)


state = llama_state

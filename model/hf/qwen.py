"""Qwen2 / Qwen2.5 and Qwen3: the Llama layout with q/k/v biases (Qwen2), per-head q/k
RMSNorm and an explicit head_dim (Qwen3), and optional sliding windows."""
from __future__ import annotations

from typing import Any

from kvserve.model.config import ModelConfig

from ..hf_support import family_rows
from .common import LLAMA_KEYS, Support, get_bool, get_int, layer_windows
from .llama import base_config, llama_state, sliding_default

PREFIX = "model."
SUPPORTED = family_rows("qwen")
_SLIDING = {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}
KEYS = {"qwen2": LLAMA_KEYS | _SLIDING, "qwen3": LLAMA_KEYS | _SLIDING | {"attention_bias"}}


def config(hf: dict[str, Any], s: Support, extra: dict[str, Any]) -> ModelConfig:
    arch = s.architecture
    n_layers = get_int(hf, "num_hidden_layers", arch)
    window, types = sliding_default(hf, n_layers)
    window, layers = layer_windows({**hf, "layer_types": hf.get("layer_types") or types},
                                   arch, n_layers, window, None)
    if s.model_type == "qwen2":
        biases = dict(qkv_bias=True, out_bias=False)  # fixed in Qwen2: q/k/v biased, o not
        qk_norm = False
    else:
        b = get_bool(hf, "attention_bias", arch)
        biases, qk_norm = dict(qkv_bias=b, out_bias=b), True
    return base_config(hf, arch, **biases, qk_norm=qk_norm, sliding_window=window,
                       sliding_layers=layers, extra=extra)


state = llama_state

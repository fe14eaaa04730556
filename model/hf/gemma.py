"""Gemma and Gemma 2: embeddings times sqrt(d), (1 + w) RMSNorm, GeGLU-tanh, explicit head_dim;
Gemma 2 adds sandwich norms, attention and final-logit soft-capping, query_pre_attn_scalar and
alternating sliding-window layers."""
from __future__ import annotations

import math
from typing import Any

from kvserve.model.config import ModelConfig

from ..hf_support import family_rows
from .common import (LLAMA_KEYS, Source, Support, get_bool, get_int, get_number,
                     layer_windows, refuse)
from .llama import base_config, llama_state

PREFIX = "model."
SUPPORTED = family_rows("gemma")
_GEMMA = LLAMA_KEYS | {"attention_bias", "hidden_activation", "use_bidirectional_attention"}
KEYS = {"gemma": _GEMMA,
        "gemma2": _GEMMA | {"query_pre_attn_scalar", "attn_logit_softcapping",
                            "final_logit_softcapping", "sliding_window", "layer_types",
                            "cache_implementation"}}
# transformers' GemmaConfig turns Gemma's legacy hidden_act "gelu" into the tanh approximation;
# Gemma 2 reads hidden_activation as written (there "gelu" would be the exact erf gelu)
GELU_TANH = {"gemma": ("gelu_pytorch_tanh", "gelu"), "gemma2": ("gelu_pytorch_tanh",)}


def config(hf: dict[str, Any], s: Support, extra: dict[str, Any]) -> ModelConfig:
    arch = s.architecture
    if hf.get("use_bidirectional_attention"):
        raise refuse(arch, "use_bidirectional_attention", True, "kvserve is causal only")
    act_key = "hidden_activation" if s.model_type == "gemma2" or hf.get("hidden_activation") \
        else "hidden_act"
    d = get_int(hf, "hidden_size", arch)
    b = get_bool(hf, "attention_bias", arch)
    options: dict[str, Any] = dict(qkv_bias=b, out_bias=b, embed_scale=math.sqrt(d),
                                   norm_offset=1.0)
    if s.model_type == "gemma2":
        n_layers = get_int(hf, "num_hidden_layers", arch)
        alternating = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                       for i in range(n_layers)]
        window, layers = layer_windows(hf, arch, n_layers, hf.get("sliding_window", 4096),
                                       alternating)
        scalar = get_number(hf, "query_pre_attn_scalar", arch, 256)
        options.update(sandwich_norm=True, attn_scale=scalar ** -0.5,
                       attn_softcap=get_number(hf, "attn_logit_softcapping", arch, 50.0),
                       final_softcap=get_number(hf, "final_logit_softcapping", arch, 30.0),
                       sliding_window=window, sliding_layers=layers)
    return base_config(hf, arch, tie_default=True, acts=GELU_TANH[s.model_type], ffn="geglu_tanh",
                       act_key=act_key, extra=extra, **options)


def state(src: Source, cfg: ModelConfig):
    return llama_state(src, cfg, gemma2=cfg.sandwich_norm)

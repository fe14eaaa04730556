"""What every family mapper shares: errors, the ``Support`` table row, config readers (ints,
tying, special ids, RoPE and sliding-window options) and the tensor source."""
from __future__ import annotations

import logging
import math
import re
from typing import Any

import torch

from ..hf_support import Support  # noqa: F401 (the families' rows, torch-free)

from kvserve.model.config import ModelConfig

log = logging.getLogger(__name__)


class HFImportError(ValueError):
    """The directory cannot be imported (missing, malformed, unsafe or unsupported)."""


class UnsupportedModelError(HFImportError):
    """The architecture or one of its options is outside what kvserve reproduces exactly."""


def refuse(arch: str, option: str, value: Any, why: str = "") -> UnsupportedModelError:
    return UnsupportedModelError(f"{arch}: unsupported option {option}={value!r}"
                                 + (f" ({why})" if why else ""))


# Config keys that do not change the function computed at inference (dropouts, init, generation
# defaults, bookkeeping). Everything else must be understood by the family mapper.
GENERIC_KEYS = frozenset("""
    transformers_version architectures model_type dtype torch_dtype _name_or_path
    output_hidden_states output_attentions return_dict chunk_size_feed_forward is_encoder_decoder
    id2label label2id problem_type use_cache initializer_range bos_token_id eos_token_id
    pad_token_id sep_token_id decoder_start_token_id tie_word_embeddings tokenizer_class
    task_specific_params finetuning_task prefix torchscript use_bfloat16 tf_legacy_loss
    is_decoder add_cross_attention pruned_heads cross_attention_hidden_size tie_encoder_decoder
    max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty
    temperature top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
    encoder_no_repeat_ngram_size bad_words_ids num_return_sequences output_scores
    return_dict_in_generate forced_bos_token_id forced_eos_token_id remove_invalid_values
    exponential_decay_length_penalty suppress_tokens begin_suppress_tokens
""".split())
# the Llama-layout families' common keys
LLAMA_KEYS = frozenset("""
    vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
    num_key_value_heads head_dim hidden_act max_position_embeddings rms_norm_eps rope_theta
    rope_scaling rope_parameters attention_dropout
""".split())

# HF tensors that are buffers, not weights: dropped without complaint.
IGNORABLE = (re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$"),  # GPT-2 causal masks
             re.compile(r"(^|\.)rotary_emb\.inv_freq$"))  # Llama-family RoPE tables


def common_checks(hf: dict[str, Any], arch: str, known: frozenset[str],
                  allow_unknown: bool) -> None:
    if hf.get("quantization_config") is not None:
        raise refuse(arch, "quantization_config", hf["quantization_config"].get("quant_method")
                     if isinstance(hf["quantization_config"], dict) else "...",
                     "quantized weights are not supported; import the unquantized model")
    for opt in ("add_cross_attention", "is_encoder_decoder"):
        if hf.get(opt):
            raise refuse(arch, opt, hf[opt])
    if hf.get("pruned_heads"):
        raise refuse(arch, "pruned_heads", hf["pruned_heads"])
    unknown = sorted(set(hf) - GENERIC_KEYS - known)
    if unknown:
        if not allow_unknown:
            raise UnsupportedModelError(
                f"{arch}: config.json has keys import-hf does not know, which might change the "
                f"model's function: {unknown}. Pass --allow-unknown-config-keys (library: "
                f"allow_unknown_keys=True) if you know they do not")
        log.warning("%s: ignoring unknown config keys %s", arch, unknown)


def get_int(hf: dict[str, Any], key: str, arch: str, default: Any = ...) -> int:
    v = hf.get(key)
    if v is None:
        if default is ...:
            raise HFImportError(f"{arch}: config.json lacks {key}")
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise HFImportError(f"{arch}: {key} must be a positive integer, got {v!r}")
    return v


def get_number(hf: dict[str, Any], key: str, arch: str, default: Any = None) -> float | None:
    v = hf.get(key, default)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1e9:
        raise refuse(arch, key, v, "must be a positive number")
    return float(v)


def get_bool(hf: dict[str, Any], key: str, arch: str, default: bool = False) -> bool:
    v = hf.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise refuse(arch, key, v, "must be true or false")
    return v


def tie(hf: dict[str, Any], arch: str, default: bool) -> bool:
    t = hf.get("tie_word_embeddings", default)
    if not isinstance(t, bool):
        raise refuse(arch, "tie_word_embeddings", t, "must be true or false")
    if hf.get("tie_encoder_decoder"):
        raise refuse(arch, "tie_encoder_decoder", hf["tie_encoder_decoder"])
    return t


def special_ids(hf: dict[str, Any], vocab: int, extra: dict[str, Any]) -> dict[str, int | None]:
    ids: dict[str, int | None] = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = hf.get(name)
        if isinstance(v, list):
            extra[name + "s"] = list(v)
            v = v[0] if v else None
        if v is not None and not (isinstance(v, int) and 0 <= v < vocab):
            log.warning("%s=%r is outside the vocabulary [0, %d); dropped (kept in extra)",
                        name, v, vocab)
            extra["hf_" + name] = v
            v = None
        ids[name] = v
    return ids


# --- RoPE --------------------------------------------------------------------------------------
ROPE_TYPES = ("default", "linear", "llama3", "longrope (su)")
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "longrope": {"short_factor", "long_factor", "original_max_position_embeddings",
                 "attention_factor", "factor"},
}


def rope(hf: dict[str, Any], arch: str, head_dim: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, ModelConfig.rope_scaling) from transformers 4.x ``rope_theta`` +
    ``rope_scaling`` or 5.x ``rope_parameters``; any other rope type is refused by name."""
    params: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        v = hf.get(key)
        if v is None:
            continue
        if not isinstance(v, dict):
            raise refuse(arch, key, v)
        params.update(v)
    theta = hf.get("rope_theta")
    if "rope_theta" in params:
        if theta is not None and float(theta) != float(params["rope_theta"]):
            raise HFImportError(f"{arch}: rope_theta={theta} disagrees with "
                                f"rope_parameters.rope_theta={params['rope_theta']}")
        theta = params["rope_theta"]
    theta = 10000.0 if theta is None else theta
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 1:
        raise refuse(arch, "rope_theta", theta)
    rtype = params.get("rope_type", params.get("type", "default"))
    rtype = "longrope" if rtype == "su" else rtype
    if rtype not in _ROPE_KEYS:
        raise refuse(arch, "rope_scaling.rope_type", rtype,
                     f"kvserve implements {', '.join(ROPE_TYPES)}")
    prf = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if prf != 1.0:
        raise refuse(arch, "partial_rotary_factor", prf, "only full rotary embeddings")
    others = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
                    - _ROPE_KEYS[rtype])
    if others:
        raise refuse(arch, "rope_parameters", {k: params[k] for k in others})
    if rtype == "default":
        return float(theta), None
    if rtype == "linear":
        return float(theta), {"type": "linear", "factor": _pos(params, "factor", arch)}
    if rtype == "llama3":
        return float(theta), {"type": "llama3", **{k: _pos(params, k, arch)
                                                   for k in sorted(_ROPE_KEYS["llama3"])}}
    # longrope (Phi-3): the attention factor is resolved here as transformers does; a top-level
    # original_max_position_embeddings wins over rope_scaling's (standardize_rope_params)
    orig = hf.get("original_max_position_embeddings")
    orig = params.get("original_max_position_embeddings") if orig is None else orig
    if not isinstance(orig, int) or orig <= 1:
        raise refuse(arch, "original_max_position_embeddings", orig)
    factor = params.get("factor") or get_int(hf, "max_position_embeddings", arch) / orig
    att = params.get("attention_factor")
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    out = {"type": "longrope", "original_max_position_embeddings": orig,
           "attention_factor": float(att)}
    for k in ("short_factor", "long_factor"):
        v = params.get(k)
        if not (isinstance(v, list) and len(v) == head_dim // 2
                and all(isinstance(x, (int, float)) and x > 0 for x in v)):
            raise refuse(arch, f"rope_scaling.{k}", v, f"needs head_dim/2 = {head_dim // 2} "
                                                       f"positive numbers")
        out[k] = [float(x) for x in v]
    return float(theta), out


def _pos(params: dict[str, Any], key: str, arch: str) -> float:
    v = params.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise refuse(arch, f"rope_scaling.{key}", v, "must be a positive number")
    return float(v) if key != "original_max_position_embeddings" else int(v)


def layer_windows(hf: dict[str, Any], arch: str, n_layers: int, window: Any,
                  default_types: list[str] | None) -> tuple[int | None, list[bool] | None]:
    """(sliding_window, sliding_layers) from ``layer_types`` (else ``default_types``: the
    family's rule); a window that covers every position is dropped."""
    types = hf.get("layer_types") or default_types
    if types is None or window is None:
        return None, None
    if not (isinstance(types, list) and len(types) == n_layers):
        raise refuse(arch, "layer_types", types, f"needs one entry per layer ({n_layers})")
    bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise refuse(arch, "layer_types", bad, "only full_attention and sliding_attention")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise refuse(arch, "sliding_window", window, "must be a positive integer")
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return None, None
    return window, (None if all(sliding) else sliding)


# --- tensors -----------------------------------------------------------------------------------
class Source:
    """HF tensors under a normalised name (optional family prefix stripped); records use."""

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str):
        self.names: dict[str, str] = {}  # normalised -> original
        for k in tensors:
            n = k[len(prefix):] if k.startswith(prefix) else k
            if n in self.names:
                raise HFImportError(f"tensors {self.names[n]} and {k} collide")
            self.names[n] = k
        self.tensors = tensors
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.names

    def take(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise HFImportError(f"missing tensor {name} in the Hugging Face weights")
        orig = self.names[name]
        self.used.add(orig)
        return self.tensors[orig].float()

    def unused(self) -> list[str]:
        return sorted(k for k in self.tensors
                      if k not in self.used and not any(p.search(k) for p in IGNORABLE))


def head(src: Source, cfg: ModelConfig, emb: torch.Tensor, sd: dict[str, torch.Tensor]) -> None:
    if cfg.tie_embeddings:
        if src.has("lm_head.weight") and not torch.equal(src.take("lm_head.weight"), emb):
            raise HFImportError("tie_word_embeddings is true but lm_head.weight differs from "
                                "the token embedding")
    else:
        if not src.has("lm_head.weight"):
            raise HFImportError("tie_word_embeddings is false but lm_head.weight is missing")
        sd["lm_head.weight"] = src.take("lm_head.weight")

"""``kvserve import-hf HF_DIR --out CKPT``: convert a local Hugging Face directory into a kvserve
checkpoint.

Only local directories are accepted (nothing is downloaded), weights are read with safetensors
only (never pickle: a directory with only ``pytorch_model.bin`` is refused), and
``transformers`` is not needed: the importer reads ``config.json`` and the safetensors files
directly. Anything the kvserve model cannot reproduce exactly is refused with a message naming
the option; see ``SUPPORTED`` (also printed by ``kvserve import-hf --help``).

After conversion every Hugging Face tensor must have been consumed (known buffers such as
rotary ``inv_freq`` and GPT-2's ``attn.bias`` masks excepted), and the written checkpoint is
loaded back and compared tensor by tensor with what was converted.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

from .checkpoint import (CONFIG, TOKENIZER, TOKENIZER_CONFIG, WEIGHTS, load_model, model_state,
                         save_checkpoint)
from .config import ModelConfig
from .transformer import Transformer

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class HFImportError(ValueError):
    """The directory cannot be imported (missing, malformed, unsafe or unsupported)."""


class UnsupportedModelError(HFImportError):
    """The architecture or one of its options is outside what kvserve reproduces exactly."""


# --- what is supported -------------------------------------------------------------------------
@dataclass(frozen=True)
class Support:
    architecture: str
    model_type: str
    family: str  # the mapper used
    maps_to: str
    refused: str


SUPPORTED: tuple[Support, ...] = (
    Support("GPT2LMHeadModel", "gpt2", "gpt2",
            "positions=learned, layernorm (layer_norm_epsilon), pre-norm + final norm, "
            "ffn gelu_tanh (gelu_new, gelu_pytorch_tanh) | gelu | relu, all biases, "
            "Conv1D weights transposed, fused c_attn = attn.qkv, tied or untied head",
            "scale_attn_weights=false, scale_attn_by_inverse_layer_idx, "
            "reorder_and_upcast_attn, add_cross_attention, pruned_heads, n_ctx != n_positions, "
            "other activation_function values"),
    Support("LlamaForCausalLM", "llama", "llama",
            "positions=rope (rope_theta, default type only), rmsnorm (rms_norm_eps), "
            "ffn swiglu (w_in = [gate; up]), attn.qkv = [q; k; v], MHA/GQA/MQA, "
            "attention_bias -> qkv_bias+out_bias, mlp_bias -> ffn_bias, tied or untied head",
            "rope_scaling (any non-null), rope types other than default, "
            "head_dim != hidden_size/num_attention_heads, hidden_act other than silu"),
    Support("MistralForCausalLM", "mistral", "llama",
            "as Llama (no biases)",
            "sliding_window < max_position_embeddings, plus everything refused for Llama"),
    Support("Qwen2ForCausalLM", "qwen2", "llama",
            "as Llama with qkv_bias=true, out_bias=false",
            "use_sliding_window=true, layer_types other than full_attention, "
            "plus everything refused for Llama"),
)
_BY_ARCH = {s.architecture: s for s in SUPPORTED}
_BY_TYPE = {s.model_type: s for s in SUPPORTED}


def supported_table() -> str:
    lines = ["supported Hugging Face architectures (anything else is refused):"]
    def wrap(label: str, text: str) -> list[str]:
        return textwrap.wrap(text, width=92, initial_indent=f"      {label}: ",
                             subsequent_indent=" " * 15)

    for s in SUPPORTED:
        lines += [f"  {s.architecture} (model_type {s.model_type})",
                  *wrap("maps to", s.maps_to), *wrap("refused", s.refused)]
    lines += textwrap.wrap("all: weights from *.safetensors only (sharded via "
                           "model.safetensors.index.json; pickle .bin/.pt refused); "
                           "quantization_config and unknown config.json keys are refused "
                           "(--allow-unknown-config-keys to override the latter); output "
                           "weights are float32", width=92, initial_indent="  ",
                           subsequent_indent="       ")
    return "\n".join(lines)


# Config keys that do not change the function computed at inference (dropouts, init, generation
# defaults, bookkeeping). Everything else must be understood by the family mapper.
_GENERIC_KEYS = frozenset("""
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
_LLAMA_KEYS = frozenset("""
    vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
    num_key_value_heads head_dim hidden_act max_position_embeddings rms_norm_eps rope_theta
    rope_scaling rope_parameters attention_dropout
""".split())
_MODEL_KEYS = {  # per model_type: the keys its mapper reads or knows to be inert
    "gpt2": frozenset("""
        vocab_size n_positions n_ctx n_embd n_layer n_head n_inner activation_function
        resid_pdrop embd_pdrop attn_pdrop layer_norm_epsilon scale_attn_weights
        scale_attn_by_inverse_layer_idx reorder_and_upcast_attn summary_type summary_use_proj
        summary_activation summary_proj_to_labels summary_first_dropout
    """.split()),
    "llama": _LLAMA_KEYS | {"attention_bias", "mlp_bias", "pretraining_tp"},
    "mistral": _LLAMA_KEYS | {"sliding_window"},
    "qwen2": _LLAMA_KEYS | {"sliding_window", "use_sliding_window", "max_window_layers",
                            "layer_types"},
}
_TIE_DEFAULT = {"gpt2": True, "llama": False, "mistral": False, "qwen2": False}

GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                    "relu": "relu"}
LLAMA_ACTIVATIONS = ("silu", "swish")  # HF's "swish" is nn.SiLU

# HF tensors that are buffers, not weights: dropped without complaint.
_IGNORABLE = (re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$"),  # GPT-2 causal masks
              re.compile(r"(^|\.)rotary_emb\.inv_freq$"))  # Llama-family RoPE tables


def _refuse(arch: str, option: str, value: Any, why: str = "") -> UnsupportedModelError:
    return UnsupportedModelError(f"{arch}: unsupported option {option}={value!r}"
                                 + (f" ({why})" if why else ""))


# --- reading the directory ---------------------------------------------------------------------
def _check_dir(hf_dir: str | Path) -> Path:
    p = Path(hf_dir)
    if not p.exists():
        raise HFImportError(f"{hf_dir}: no such directory (import-hf only reads local "
                            f"directories; download with `huggingface-cli download` first)")
    if not p.is_dir():
        raise HFImportError(f"{hf_dir}: not a directory")
    if not (p / "config.json").is_file():
        raise HFImportError(f"{hf_dir}: no config.json; not a Hugging Face model directory")
    return p


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((hf_dir / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise HFImportError(f"{hf_dir / 'config.json'}: invalid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise HFImportError(f"{hf_dir / 'config.json'}: expected a JSON object")
    return cfg


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files holding the weights; refuses pickle-only directories."""
    index = hf_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFImportError(f"{index}: malformed safetensors index ({e})") from None
        names = sorted(set(weight_map.values()))
        for n in names:
            if not isinstance(n, str) or "/" in n or "\\" in n or n in (".", ".."):
                raise HFImportError(f"{index}: refusing shard name {n!r} (must be a plain file "
                                    f"name inside the directory)")
            if not (hf_dir / n).is_file():
                raise HFImportError(f"{index}: shard {n} is missing from {hf_dir}")
        return [hf_dir / n for n in names]
    if (hf_dir / SINGLE).is_file():
        return [hf_dir / SINGLE]
    found = sorted(hf_dir.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise HFImportError(
            f"{hf_dir}: only pickle weights found ({', '.join(pickles)}); import-hf reads "
            f"safetensors only, because loading pickle can run arbitrary code. Convert them "
            f"first in an environment you trust, e.g. `python -c \"from transformers import "
            f"AutoModelForCausalLM as A; A.from_pretrained('DIR').save_pretrained('DIR', "
            f"safe_serialization=True)\"`")
    raise HFImportError(f"{hf_dir}: no weights (expected {SINGLE} or {INDEX} with its shards)")


def read_tensors(files: list[Path]) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of all files (duplicates are an error) and their dtype(s) as a string."""
    out: dict[str, torch.Tensor] = {}
    dtypes: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for k in st.keys():
                    if k in out:
                        raise HFImportError(f"tensor {k} appears in more than one file "
                                            f"({f.name})")
                    t = st.get_tensor(k)
                    dtypes.add(str(t.dtype).removeprefix("torch."))
                    out[k] = t
        except SafetensorError as e:
            raise HFImportError(f"{f}: not a readable safetensors file ({e})") from None
    return out, ",".join(sorted(dtypes))


# --- config mapping ----------------------------------------------------------------------------
def _special_ids(hf: dict[str, Any], vocab: int, extra: dict[str, Any]) -> dict[str, int | None]:
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


def _tie(hf: dict[str, Any], model_type: str, arch: str) -> bool:
    tie = hf.get("tie_word_embeddings", _TIE_DEFAULT[model_type])
    if not isinstance(tie, bool):
        raise _refuse(arch, "tie_word_embeddings", tie, "must be true or false")
    if hf.get("tie_encoder_decoder"):
        raise _refuse(arch, "tie_encoder_decoder", hf["tie_encoder_decoder"])
    return tie


def _common_checks(hf: dict[str, Any], arch: str, model_type: str, allow_unknown: bool) -> None:
    if hf.get("quantization_config") is not None:
        raise _refuse(arch, "quantization_config", hf["quantization_config"].get("quant_method")
                      if isinstance(hf["quantization_config"], dict) else "...",
                      "quantized weights are not supported; import the unquantized model")
    for opt in ("add_cross_attention", "is_encoder_decoder"):
        if hf.get(opt):
            raise _refuse(arch, opt, hf[opt])
    if hf.get("pruned_heads"):
        raise _refuse(arch, "pruned_heads", hf["pruned_heads"])
    unknown = sorted(set(hf) - _GENERIC_KEYS - _MODEL_KEYS[model_type])
    if unknown:
        if not allow_unknown:
            raise UnsupportedModelError(
                f"{arch}: config.json has keys import-hf does not know, which might change the "
                f"model's function: {unknown}. Pass --allow-unknown-config-keys (library: "
                f"allow_unknown_keys=True) if you know they do not")
        log.warning("%s: ignoring unknown config keys %s", arch, unknown)


def _int(hf: dict[str, Any], key: str, arch: str, default: Any = ...) -> int:
    v = hf.get(key)
    if v is None:
        if default is ...:
            raise HFImportError(f"{arch}: config.json lacks {key}")
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise HFImportError(f"{arch}: {key} must be a positive integer, got {v!r}")
    return v


def gpt2_config(hf: dict[str, Any], arch: str, extra: dict[str, Any]) -> ModelConfig:
    for opt, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("reorder_and_upcast_attn", False)):
        if hf.get(opt, ok) != ok:
            raise _refuse(arch, opt, hf[opt], f"kvserve supports only {opt}={ok!r}".lower())
    act = hf.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise _refuse(arch, "activation_function", act,
                      f"supported: {sorted(GPT2_ACTIVATIONS)}")
    d = _int(hf, "n_embd", arch)
    n_pos = _int(hf, "n_positions", arch)
    if "n_ctx" in hf and hf["n_ctx"] != n_pos:
        raise _refuse(arch, "n_ctx", hf["n_ctx"], f"differs from n_positions={n_pos}")
    vocab = _int(hf, "vocab_size", arch)
    n_inner = hf.get("n_inner")
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=_int(hf, "n_layer", arch),
        n_heads=_int(hf, "n_head", arch), n_kv_heads=None,
        d_ff=4 * d if n_inner is None else _int(hf, "n_inner", arch),
        max_seq_len=n_pos, positions="learned", norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), norm_placement="pre",
        final_norm=True, ffn=GPT2_ACTIVATIONS[act], qkv_bias=True, out_bias=True,
        ffn_bias=True, tie_embeddings=_tie(hf, "gpt2", arch), dropout=0.0,
        **_special_ids(hf, vocab, extra), extra=extra)


def _rope_theta(hf: dict[str, Any], arch: str) -> float:
    if hf.get("rope_scaling") is not None:
        raise _refuse(arch, "rope_scaling", hf["rope_scaling"],
                      "kvserve implements plain RoPE only")
    theta = hf.get("rope_theta")
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise _refuse(arch, "rope_parameters", params)
        rtype = params.get("rope_type", params.get("type", "default"))
        if rtype != "default":
            raise _refuse(arch, "rope_parameters.rope_type", rtype,
                          "kvserve implements plain RoPE only")
        others = sorted(set(params) - {"rope_type", "type", "rope_theta"})
        if others:
            raise _refuse(arch, "rope_parameters", {k: params[k] for k in others})
        if "rope_theta" in params:
            if theta is not None and float(theta) != float(params["rope_theta"]):
                raise HFImportError(f"{arch}: rope_theta={theta} disagrees with "
                                    f"rope_parameters.rope_theta={params['rope_theta']}")
            theta = params["rope_theta"]
    theta = 10000.0 if theta is None else theta
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 1:
        raise _refuse(arch, "rope_theta", theta)
    return float(theta)


def llama_config(hf: dict[str, Any], arch: str, model_type: str,
                 extra: dict[str, Any]) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    if act not in LLAMA_ACTIVATIONS:
        raise _refuse(arch, "hidden_act", act, "kvserve's swiglu uses silu")
    d = _int(hf, "hidden_size", arch)
    n_heads = _int(hf, "num_attention_heads", arch)
    n_kv = _int(hf, "num_key_value_heads", arch, default=n_heads)
    if d % n_heads:
        raise _refuse(arch, "num_attention_heads", n_heads, f"does not divide hidden_size={d}")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != d // n_heads:
        raise _refuse(arch, "head_dim", head_dim, f"kvserve needs head_dim == hidden_size / "
                                                  f"num_attention_heads = {d // n_heads}")
    max_pos = _int(hf, "max_position_embeddings", arch)
    attention_bias, mlp_bias = False, False  # Mistral/Qwen2 fix their biases (HF ignores keys)
    if model_type == "llama":
        attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    qkv_bias = out_bias = bool(attention_bias)
    if model_type == "mistral":
        sw = hf.get("sliding_window")
        if sw is not None and sw < max_pos:
            raise _refuse(arch, "sliding_window", sw,
                          f"kvserve has no sliding-window attention; only null or >= "
                          f"max_position_embeddings={max_pos} is exact")
    elif model_type == "qwen2":
        if hf.get("use_sliding_window"):
            raise _refuse(arch, "use_sliding_window", True,
                          "kvserve has no sliding-window attention")
        bad = sorted({t for t in hf.get("layer_types") or [] if t != "full_attention"})
        if bad:
            raise _refuse(arch, "layer_types", bad, "only full_attention is supported")
        qkv_bias, out_bias = True, False  # fixed in Qwen2: q/k/v biased, o not
    for opt, v in (("attention_bias", attention_bias), ("mlp_bias", mlp_bias)):
        if not isinstance(v, bool):
            raise _refuse(arch, opt, v, "must be true or false")
    vocab = _int(hf, "vocab_size", arch)
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=_int(hf, "num_hidden_layers", arch),
        n_heads=n_heads, n_kv_heads=n_kv, d_ff=_int(hf, "intermediate_size", arch),
        max_seq_len=max_pos, positions="rope", rope_base=_rope_theta(hf, arch), norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), norm_placement="pre", final_norm=True,
        ffn="swiglu", qkv_bias=qkv_bias, out_bias=out_bias, ffn_bias=bool(mlp_bias),
        tie_embeddings=_tie(hf, model_type, arch), dropout=0.0,
        **_special_ids(hf, vocab, extra), extra=extra)


def identify(hf: dict[str, Any]) -> Support:
    archs = hf.get("architectures")
    model_type = hf.get("model_type")
    if archs is None:
        if model_type not in _BY_TYPE:
            raise UnsupportedModelError(f"unsupported model_type {model_type!r} (and no "
                                        f"architectures); supported: {sorted(_BY_ARCH)}")
        log.warning("config.json lists no architectures; assuming %s from model_type %s",
                    _BY_TYPE[model_type].architecture, model_type)
        return _BY_TYPE[model_type]
    if not isinstance(archs, list) or len(archs) != 1:
        raise UnsupportedModelError(f"architectures={archs!r}: expected exactly one")
    arch = archs[0]
    if arch not in _BY_ARCH:
        raise UnsupportedModelError(f"unsupported architecture {arch!r}; supported: "
                                    f"{sorted(_BY_ARCH)}")
    s = _BY_ARCH[arch]
    if model_type != s.model_type:
        raise UnsupportedModelError(f"{arch} with model_type {model_type!r} (expected "
                                    f"{s.model_type!r})")
    return s


def map_config(hf: dict[str, Any], allow_unknown_keys: bool = False) -> ModelConfig:
    s = identify(hf)
    _common_checks(hf, s.architecture, s.model_type, allow_unknown_keys)
    extra: dict[str, Any] = {"imported_from": s.model_type, "hf_architecture": s.architecture}
    if "transformers_version" in hf:
        extra["hf_transformers_version"] = hf["transformers_version"]
    try:
        if s.family == "gpt2":
            return gpt2_config(hf, s.architecture, extra)
        return llama_config(hf, s.architecture, s.model_type, extra)
    except ValueError as e:
        if isinstance(e, HFImportError):
            raise
        raise HFImportError(f"{s.architecture}: the kvserve config cannot express this model: "
                            f"{e}") from None


# --- tensor mapping ----------------------------------------------------------------------------
class _Source:
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
                      if k not in self.used and not any(p.search(k) for p in _IGNORABLE))


def _head(src: _Source, cfg: ModelConfig, emb: torch.Tensor, sd: dict[str, torch.Tensor]) -> None:
    if cfg.tie_embeddings:
        if src.has("lm_head.weight") and not torch.equal(src.take("lm_head.weight"), emb):
            raise HFImportError("tie_word_embeddings is true but lm_head.weight differs from "
                                "the token embedding")
    else:
        if not src.has("lm_head.weight"):
            raise HFImportError("tie_word_embeddings is false but lm_head.weight is missing")
        sd["lm_head.weight"] = src.take("lm_head.weight")


def gpt2_state(src: _Source, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    sd = {"tok_emb.weight": src.take("wte.weight"), "pos_emb.weight": src.take("wpe.weight")}
    for i in range(cfg.n_layers):
        h, o = f"h.{i}.", f"layers.{i}."
        for hf_name, kv_name, conv in (("ln_1", "norm1", False), ("ln_2", "norm2", False),
                                       ("attn.c_attn", "attn.qkv", True),
                                       ("attn.c_proj", "attn.out", True),
                                       ("mlp.c_fc", "ffn.w_in", True),
                                       ("mlp.c_proj", "ffn.w_out", True)):
            w = src.take(h + hf_name + ".weight")
            sd[o + kv_name + ".weight"] = w.t().contiguous() if conv else w  # Conv1D: (in, out)
            sd[o + kv_name + ".bias"] = src.take(h + hf_name + ".bias")
    sd["norm_f.weight"], sd["norm_f.bias"] = src.take("ln_f.weight"), src.take("ln_f.bias")
    _head(src, cfg, sd["tok_emb.weight"], sd)
    return sd


def llama_state(src: _Source, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    sd = {"tok_emb.weight": src.take("embed_tokens.weight")}
    for i in range(cfg.n_layers):
        h, o = f"layers.{i}.", f"layers.{i}."
        sd[o + "norm1.weight"] = src.take(h + "input_layernorm.weight")
        sd[o + "norm2.weight"] = src.take(h + "post_attention_layernorm.weight")
        qkv = [h + f"self_attn.{p}_proj" for p in "qkv"]
        sd[o + "attn.qkv.weight"] = torch.cat([src.take(n + ".weight") for n in qkv])
        if cfg.qkv_bias:
            sd[o + "attn.qkv.bias"] = torch.cat([src.take(n + ".bias") for n in qkv])
        sd[o + "attn.out.weight"] = src.take(h + "self_attn.o_proj.weight")
        if cfg.out_bias:
            sd[o + "attn.out.bias"] = src.take(h + "self_attn.o_proj.bias")
        gate_up = [h + "mlp.gate_proj", h + "mlp.up_proj"]
        sd[o + "ffn.w_in.weight"] = torch.cat([src.take(n + ".weight") for n in gate_up])
        sd[o + "ffn.w_out.weight"] = src.take(h + "mlp.down_proj.weight")
        if cfg.ffn_bias:
            sd[o + "ffn.w_in.bias"] = torch.cat([src.take(n + ".bias") for n in gate_up])
            sd[o + "ffn.w_out.bias"] = src.take(h + "mlp.down_proj.bias")
    sd["norm_f.weight"] = src.take("norm.weight")
    _head(src, cfg, sd["tok_emb.weight"], sd)
    return sd


_STATE: dict[str, tuple[str, Callable[[_Source, ModelConfig], dict[str, torch.Tensor]]]] = {
    "gpt2": ("transformer.", gpt2_state),
    "llama": ("model.", llama_state),
}


def build_model(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> Transformer:
    """A kvserve Transformer holding exactly ``sd`` (shapes and key sets checked)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")
    missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or extra:
        raise HFImportError(f"converted weights do not fit the kvserve model: missing={missing},"
                            f" unexpected={extra}")
    bad = [f"{k}: {tuple(sd[k].shape)} != {expected[k]}" for k in expected
           if tuple(sd[k].shape) != expected[k]]
    if bad:
        raise HFImportError("converted weights have the wrong shapes: " + "; ".join(bad))
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise HFImportError(f"kvserve tensors left unset: {still_meta}")
    return model.eval()


# --- chat template and generation settings ----------------------------------------------------
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        v = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise HFImportError(f"{path.name} is not valid JSON ({e})") from None
    return v if isinstance(v, dict) else {}


def chat_config(src_dir: Path) -> dict[str, Any] | None:
    """The chat template (chat_template.jinja > chat_template.json > tokenizer_config.json's
    chat_template, as transformers loads them) and the special-token strings the template
    may use, as a slim tokenizer_config.json; None when the model has no template."""
    tc = _read_json(src_dir / "tokenizer_config.json")
    template: Any = tc.get("chat_template")
    if (src_dir / "chat_template.json").is_file():
        template = _read_json(src_dir / "chat_template.json").get("chat_template", template)
    if (src_dir / "chat_template.jinja").is_file():
        template = (src_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if not template:
        return None
    stm = _read_json(src_dir / "special_tokens_map.json")
    out: dict[str, Any] = {"chat_template": template}
    for name in _SPECIAL_TOKENS:
        v = tc.get(name, stm.get(name))
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[name] = v
    return out


def _generation_eos_ids(src_dir: Path, vocab: int) -> list[int]:
    """generation_config.json's eos_token_id (an id or a list): every one ends generation."""
    v = _read_json(src_dir / "generation_config.json").get("eos_token_id")
    ids = v if isinstance(v, list) else [v]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab]


# --- the import --------------------------------------------------------------------------------
def import_hf(hf_dir: str | Path, out_dir: str | Path, overwrite: bool = False,
              allow_unknown_keys: bool = False) -> Path:
    """Convert the local Hugging Face directory ``hf_dir`` into a kvserve checkpoint at
    ``out_dir`` (float32 weights). Raises ``HFImportError`` on anything not imported exactly."""
    src_dir = _check_dir(hf_dir)
    out = Path(out_dir)
    if out.resolve() == src_dir.resolve():
        raise HFImportError("--out must differ from the Hugging Face directory (both use "
                            "config.json)")
    if not overwrite and ((out / CONFIG).exists() or (out / WEIGHTS).exists()):
        raise HFImportError(f"{out} already holds a checkpoint; pass --overwrite to replace it")

    hf = read_hf_config(src_dir)
    cfg = map_config(hf, allow_unknown_keys=allow_unknown_keys)
    files = weight_files(src_dir)
    tensors, dtypes = read_tensors(files)
    family = _BY_ARCH[cfg.extra["hf_architecture"]].family
    prefix, mapper = _STATE[family]
    src = _Source(tensors, prefix)
    sd = mapper(src, cfg)
    unused = src.unused()
    if unused:
        raise HFImportError(f"{len(unused)} Hugging Face tensors were not consumed, so the "
                            f"model has parts kvserve would drop: {unused[:20]}"
                            + (" ..." if len(unused) > 20 else ""))
    gen_eos = _generation_eos_ids(src_dir, cfg.vocab_size)
    if gen_eos:
        known = list(cfg.extra.get("eos_token_ids") or [])
        cfg.extra["eos_token_ids"] = known + [i for i in gen_eos if i not in known]
    cfg.extra.update(hf_dtype=dtypes, hf_weight_files=[f.name for f in files],
                     hf_config_sha256=hashlib.sha256((src_dir / "config.json").read_bytes())
                     .hexdigest())
    model = build_model(cfg, sd)

    tok = src_dir / TOKENIZER
    tokenizer_json = tok.read_text(encoding="utf-8") if tok.is_file() else None
    if tokenizer_json is None:
        log.warning("%s has no tokenizer.json; the checkpoint works with token ids only",
                    src_dir)
    chat = chat_config(src_dir)
    extra = {TOKENIZER_CONFIG: (json.dumps(chat, indent=2, sort_keys=True) + "\n").encode()} \
        if chat else None
    if chat is None:
        log.info("%s has no chat template; chat requests to the served model will be refused",
                 src_dir)
    save_checkpoint(out, model, tokenizer_json=tokenizer_json, extra_files=extra)

    # Verify: the written checkpoint loads into the kvserve model and holds exactly what
    # was converted.
    written = model_state(load_model(out))
    want = model_state(model)
    diff = sorted(k for k in want if k not in written or not torch.equal(written[k], want[k]))
    if diff or set(written) != set(want):
        raise HFImportError(f"checkpoint verification failed for {sorted(set(diff))}")
    log.info("imported %s (%s, %d tensors from %d file(s), %.1fM parameters) -> %s",
             src_dir, cfg.extra["hf_architecture"], len(tensors), len(files),
             model.num_parameters() / 1e6, out)
    return out


# --- CLI ---------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = supported_table()
    parser.add_argument("hf_dir", metavar="HF_DIR",
                        help="local Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, metavar="CKPT",
                        help="kvserve checkpoint directory to write")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing checkpoint at --out")
    parser.add_argument("--allow-unknown-config-keys", action="store_true",
                        help="warn about, instead of refusing, config.json keys import-hf "
                             "does not know")


def main(args: argparse.Namespace) -> int:
    try:
        out = import_hf(args.hf_dir, args.out, overwrite=args.overwrite,
                        allow_unknown_keys=args.allow_unknown_config_keys)
    except (HFImportError, OSError) as e:
        print(f"kvserve import-hf: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0

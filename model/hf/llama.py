"""Llama 1/2/3.x (SmolLM2 is a Llama), Mistral and SmolLM3: the Llama layout, and the tensor
mapping the Qwen and Gemma mappers reuse."""
from __future__ import annotations

from typing import Any

import torch

from kvserve.model.config import ModelConfig

from ..hf_support import family_rows
from .common import (LLAMA_KEYS, Source, Support, get_bool, get_int, head, layer_windows,
                     refuse, rope, special_ids, tie)

PREFIX = "model."
SUPPORTED = family_rows("llama")
_SLIDING = {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}
KEYS = {
    "llama": LLAMA_KEYS | {"attention_bias", "mlp_bias", "pretraining_tp"},
    "mistral": LLAMA_KEYS | {"sliding_window"},
    "smollm3": LLAMA_KEYS | _SLIDING | {"attention_bias", "mlp_bias", "no_rope_layers",
                                        "no_rope_layer_interval"},
}
SILU = ("silu", "swish")  # HF's "swish" is nn.SiLU


def base_config(hf: dict[str, Any], arch: str, *, tie_default: bool = False,
                acts: tuple[str, ...] = SILU, ffn: str = "swiglu",
                act_key: str = "hidden_act", eps_default: float = 1e-6,
                **options: Any) -> ModelConfig:
    """The Llama-layout config; ``options`` are further ModelConfig fields of the family.
    A key the config leaves out takes its family's transformers default (``eps_default``:
    ``rms_norm_eps``'s)."""
    act = hf.get(act_key, acts[0])
    if act not in acts:
        raise refuse(arch, act_key, act, f"kvserve's {ffn} needs one of {list(acts)}")
    d = get_int(hf, "hidden_size", arch)
    n_heads = get_int(hf, "num_attention_heads", arch)
    n_kv = get_int(hf, "num_key_value_heads", arch, default=n_heads)
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if d % n_heads:
            raise refuse(arch, "num_attention_heads", n_heads, f"does not divide hidden_size={d}")
        head_dim = d // n_heads
    head_dim = get_int({"head_dim": head_dim}, "head_dim", arch)
    theta, scaling = rope(hf, arch, head_dim)
    vocab = get_int(hf, "vocab_size", arch)
    extra = options.pop("extra")
    max_pos = get_int(hf, "max_position_embeddings", arch)
    if (options.get("sliding_window") or 0) >= max_pos:  # a window covering everything
        options.update(sliding_window=None, sliding_layers=None)
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=get_int(hf, "num_hidden_layers", arch),
        n_heads=n_heads, n_kv_heads=n_kv, d_ff=get_int(hf, "intermediate_size", arch),
        max_seq_len=max_pos, positions="rope",
        rope_base=theta, rope_scaling=scaling, norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", eps_default)), norm_placement="pre",
        final_norm=True,
        ffn=ffn, tie_embeddings=tie(hf, arch, tie_default), dropout=0.0,
        explicit_head_dim=None if head_dim * n_heads == d else head_dim,
        **special_ids(hf, vocab, extra), extra=extra, **options)


def sliding_default(hf: dict[str, Any], n_layers: int, window: int | None = 4096
                    ) -> tuple[Any, list[str] | None]:
    """Qwen2 / Qwen3 / SmolLM3: a window only with use_sliding_window, on the layers from
    max_window_layers on (unless layer_types says which); ``window``: the family's
    ``sliding_window`` when the config leaves it out (transformers': Qwen 4096, SmolLM3
    none)."""
    if not hf.get("use_sliding_window"):
        return None, None
    start = hf.get("max_window_layers", 0) or 0
    types = ["sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]
    return hf.get("sliding_window", window), types


def config(hf: dict[str, Any], s: Support, extra: dict[str, Any]) -> ModelConfig:
    arch, mt = s.architecture, s.model_type
    n_layers = get_int(hf, "num_hidden_layers", arch)
    bias = get_bool(hf, "attention_bias", arch) if mt != "mistral" else False
    mlp_bias = get_bool(hf, "mlp_bias", arch) if mt != "mistral" else False
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise refuse(arch, "pretraining_tp", hf["pretraining_tp"])
    window, layers = None, None
    if mt == "mistral":
        window, layers = layer_windows(hf, arch, n_layers, hf.get("sliding_window", 4096),
                                       ["sliding_attention"] * n_layers)
    elif mt == "smollm3":
        w, types = sliding_default(hf, n_layers, window=None)
        window, layers = layer_windows({**hf, "layer_types": hf.get("layer_types") or types},
                                       arch, n_layers, w, None)
    rope_layers = None
    if mt == "smollm3":
        nr = hf.get("no_rope_layers")
        if nr is not None:
            if not (isinstance(nr, list) and len(nr) == n_layers and set(nr) <= {0, 1}):
                raise refuse(arch, "no_rope_layers", nr, "needs one 0/1 per layer")
            rope_layers = None if all(nr) else [bool(x) for x in nr]
    return base_config(hf, arch, qkv_bias=bias, out_bias=bias, ffn_bias=mlp_bias,
                       sliding_window=window, sliding_layers=layers, rope_layers=rope_layers,
                       extra=extra, tie_default=mt == "smollm3")


def llama_state(src: Source, cfg: ModelConfig, *, gemma2: bool = False) -> dict[str, torch.Tensor]:
    """Llama tensor names -> kvserve. ``gemma2``: the four norms of Gemma 2's sandwich."""
    sd = {"tok_emb.weight": src.take("embed_tokens.weight")}
    for i in range(cfg.n_layers):
        h, o = f"layers.{i}.", f"layers.{i}."
        sd[o + "norm1.weight"] = src.take(h + "input_layernorm.weight")
        if gemma2:
            sd[o + "norm1_post.weight"] = src.take(h + "post_attention_layernorm.weight")
            sd[o + "norm2.weight"] = src.take(h + "pre_feedforward_layernorm.weight")
            sd[o + "norm2_post.weight"] = src.take(h + "post_feedforward_layernorm.weight")
        else:
            sd[o + "norm2.weight"] = src.take(h + "post_attention_layernorm.weight")
        if src.has(h + "self_attn.qkv_proj.weight"):  # Phi-3: fused [q; k; v]
            sd[o + "attn.qkv.weight"] = src.take(h + "self_attn.qkv_proj.weight")
        else:
            qkv = [h + f"self_attn.{p}_proj" for p in "qkv"]
            sd[o + "attn.qkv.weight"] = torch.cat([src.take(n + ".weight") for n in qkv])
            if cfg.qkv_bias:
                sd[o + "attn.qkv.bias"] = torch.cat([src.take(n + ".bias") for n in qkv])
        if cfg.qk_norm:
            sd[o + "attn.q_norm.weight"] = src.take(h + "self_attn.q_norm.weight")
            sd[o + "attn.k_norm.weight"] = src.take(h + "self_attn.k_norm.weight")
        sd[o + "attn.out.weight"] = src.take(h + "self_attn.o_proj.weight")
        if cfg.out_bias:
            sd[o + "attn.out.bias"] = src.take(h + "self_attn.o_proj.bias")
        if src.has(h + "mlp.gate_up_proj.weight"):  # Phi-3: fused [gate; up]
            sd[o + "ffn.w_in.weight"] = src.take(h + "mlp.gate_up_proj.weight")
        else:
            gate_up = [h + "mlp.gate_proj", h + "mlp.up_proj"]
            sd[o + "ffn.w_in.weight"] = torch.cat([src.take(n + ".weight") for n in gate_up])
            if cfg.ffn_bias:
                sd[o + "ffn.w_in.bias"] = torch.cat([src.take(n + ".bias") for n in gate_up])
        sd[o + "ffn.w_out.weight"] = src.take(h + "mlp.down_proj.weight")
        if cfg.ffn_bias:
            sd[o + "ffn.w_out.bias"] = src.take(h + "mlp.down_proj.bias")
    sd["norm_f.weight"] = src.take("norm.weight")
    head(src, cfg, sd["tok_emb.weight"], sd)
    return sd


state = llama_state

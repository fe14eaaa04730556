"""GPT-2: learned positions, LayerNorm, Conv1D weights, fused c_attn."""
from __future__ import annotations

from typing import Any

import torch

from kvserve.model.config import ModelConfig

from ..hf_support import family_rows
from .common import Source, Support, get_int, head, refuse, special_ids, tie

PREFIX = "transformer."
SUPPORTED = family_rows("gpt2")
KEYS = {"gpt2": frozenset("""
    vocab_size n_positions n_ctx n_embd n_layer n_head n_inner activation_function
    resid_pdrop embd_pdrop attn_pdrop layer_norm_epsilon scale_attn_weights
    scale_attn_by_inverse_layer_idx reorder_and_upcast_attn summary_type summary_use_proj
    summary_activation summary_proj_to_labels summary_first_dropout
""".split())}
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
               "relu": "relu"}


def config(hf: dict[str, Any], s: Support, extra: dict[str, Any]) -> ModelConfig:
    arch = s.architecture
    for opt, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("reorder_and_upcast_attn", False)):
        if hf.get(opt, ok) != ok:
            raise refuse(arch, opt, hf[opt], f"kvserve supports only {opt}={ok!r}".lower())
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise refuse(arch, "activation_function", act, f"supported: {sorted(ACTIVATIONS)}")
    d = get_int(hf, "n_embd", arch)
    n_pos = get_int(hf, "n_positions", arch)
    if "n_ctx" in hf and hf["n_ctx"] != n_pos:
        raise refuse(arch, "n_ctx", hf["n_ctx"], f"differs from n_positions={n_pos}")
    vocab = get_int(hf, "vocab_size", arch)
    n_inner = hf.get("n_inner")
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=get_int(hf, "n_layer", arch),
        n_heads=get_int(hf, "n_head", arch), n_kv_heads=None,
        d_ff=4 * d if n_inner is None else get_int(hf, "n_inner", arch),
        max_seq_len=n_pos, positions="learned", norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), norm_placement="pre",
        final_norm=True, ffn=ACTIVATIONS[act], qkv_bias=True, out_bias=True,
        ffn_bias=True, tie_embeddings=tie(hf, arch, True), dropout=0.0,
        **special_ids(hf, vocab, extra), extra=extra)


def state(src: Source, cfg: ModelConfig) -> dict[str, torch.Tensor]:
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
    head(src, cfg, sd["tok_emb.weight"], sd)
    return sd

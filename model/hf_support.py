"""What ``kvserve import-hf`` converts, and what it refuses (also its ``--help`` epilog): one
row per architecture, read by each family's mapper (``kvserve.model.hf.<family>``). No torch
here, so ``kvserve import-hf --help`` answers at once."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Support:
    architecture: str
    model_type: str
    family: str  # the mapper module (kvserve.model.hf.<family>)
    maps_to: str
    refused: str


_ROPE = "rope_theta + rope_scaling default | linear | llama3 | longrope"

SUPPORTED: tuple[Support, ...] = (
    # --- gpt2 (kvserve.model.hf.gpt2)
    Support("GPT2LMHeadModel", "gpt2", "gpt2",
            "positions=learned, layernorm (layer_norm_epsilon), pre-norm + final norm, "
            "ffn gelu_tanh (gelu_new, gelu_pytorch_tanh) | gelu | relu, all biases, "
            "Conv1D weights transposed, fused c_attn = attn.qkv, tied or untied head",
            "scale_attn_weights=false, scale_attn_by_inverse_layer_idx, "
            "reorder_and_upcast_attn, add_cross_attention, pruned_heads, n_ctx != n_positions, "
            "other activation_function values"),
    # --- llama (kvserve.model.hf.llama)
    Support("LlamaForCausalLM", "llama", "llama",
            f"positions=rope ({_ROPE}), rmsnorm (rms_norm_eps), ffn swiglu (w_in = [gate; up]),"
            " attn.qkv = [q; k; v], MHA/GQA/MQA, head_dim, attention_bias -> qkv_bias+out_bias,"
            " mlp_bias -> ffn_bias, tied or untied head (SmolLM2 included)",
            "other rope types (dynamic, yarn, ...), partial_rotary_factor != 1, "
            "hidden_act other than silu, pretraining_tp > 1"),
    Support("MistralForCausalLM", "mistral", "llama",
            "as Llama (no biases), sliding_window on every layer",
            "everything refused for Llama"),
    Support("SmolLM3ForCausalLM", "smollm3", "llama",
            "as Llama, no_rope_layers (per-layer RoPE on/off), use_sliding_window + "
            "layer_types", "everything refused for Llama"),
    # --- qwen (kvserve.model.hf.qwen)
    Support("Qwen2ForCausalLM", "qwen2", "qwen",
            "as Llama with qkv_bias=true, out_bias=false; use_sliding_window + "
            "max_window_layers / layer_types -> per-layer sliding windows",
            "everything refused for Llama"),
    Support("Qwen3ForCausalLM", "qwen3", "qwen",
            "as Llama with q_norm/k_norm (per-head RMSNorm before RoPE) -> qk_norm, explicit "
            "head_dim, attention_bias -> qkv_bias+out_bias, sliding windows as Qwen2",
            "everything refused for Llama"),
    # --- gemma (kvserve.model.hf.gemma)
    Support("GemmaForCausalLM", "gemma", "gemma",
            "as Llama with embed_scale=sqrt(hidden_size), norm_offset=1 ((1 + w) RMSNorm), "
            "ffn geglu_tanh (gelu_pytorch_tanh; legacy 'gelu' means tanh too), explicit "
            "head_dim, attention_bias -> qkv_bias+out_bias, tied head by default",
            "use_bidirectional_attention, other activations, everything refused for Llama"),
    Support("Gemma2ForCausalLM", "gemma2", "gemma",
            "as Gemma plus sandwich norms (pre/post attention and feed-forward), "
            "attn_logit_softcapping -> attn_softcap, final_logit_softcapping -> final_softcap, "
            "query_pre_attn_scalar -> attn_scale, sliding_window on layer_types' sliding layers "
            "(default: every other layer, from the first)",
            "use_bidirectional_attention, everything refused for Gemma"),
    # --- phi3 (kvserve.model.hf.phi3)
    Support("Phi3ForCausalLM", "phi3", "phi3",
            "as Llama (no biases) with fused qkv_proj = attn.qkv and gate_up_proj = ffn.w_in, "
            "sliding_window on every layer, rope_scaling longrope/su (short/long factors, "
            "original_max_position_embeddings, attention factor; short factors while a "
            "sequence has at most original_max_position_embeddings tokens, long factors for "
            "all of it once it has more: a sequence crossing it while decoding is recomputed "
            "once there, as transformers' generate does; decided per request, as transformers "
            "computes that sequence alone, where its batched generate decides over the batch)",
            "partial_rotary_factor != 1, everything refused for Llama"),
)


def family_rows(family: str) -> tuple[Support, ...]:
    return tuple(s for s in SUPPORTED if s.family == family)


def supported_table() -> str:
    lines = ["supported Hugging Face architectures (anything else is refused):"]

    def wrap(label: str, text: str) -> list[str]:
        return textwrap.wrap(text, width=92, initial_indent=f"      {label}: ",
                             subsequent_indent=" " * 15)

    for s in SUPPORTED:
        lines += [f"  {s.architecture} (model_type {s.model_type}, mapper "
                  f"kvserve.model.hf.{s.family})",
                  *wrap("maps to", s.maps_to), *wrap("refused", s.refused)]
    lines += textwrap.wrap("all: weights from *.safetensors only (sharded via "
                           "model.safetensors.index.json; pickle .bin/.pt refused); "
                           "quantization_config and unknown config.json keys are refused "
                           "(--allow-unknown-config-keys to override the latter); output "
                           "weights are float32; generation_config.json eos ids (all of them) "
                           "and sampling defaults are recorded; tokenizer.json, "
                           "tokenizer_config.json, special_tokens_map.json and chat templates "
                           "are copied", width=92, initial_indent="  ",
                           subsequent_indent="       ")
    return "\n".join(lines)

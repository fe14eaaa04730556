"""What ``kvserve import-hf`` converts, and what it refuses (also its ``--help`` epilog). No
torch here, so ``kvserve import-hf --help`` answers at once."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass


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

"""Tiny random Hugging Face models saved as local safetensors directories (offline, float32).

``transformers`` is a test-only dependency: the importer itself never imports it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 300
SEED = 1234


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0; perturb every tensor so that a wrong mapping
    of any of them (e.g. swapped q/k biases, gate/up order) shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def build_hf(kind: str, **overrides: Any) -> torch.nn.Module:
    """An eval-mode, float32, randomly initialised HF causal LM of the given family."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  attn_implementation="eager")
    llama_like = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5)
    if kind == "gpt2":
        cfg = tf.GPT2Config(**{**common, **dict(n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                                 bos_token_id=VOCAB - 1,
                                                 eos_token_id=VOCAB - 1), **overrides})
        cls = tf.GPT2LMHeadModel
    elif kind == "llama":
        cfg = tf.LlamaConfig(**{**common, **llama_like, **overrides})
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":
        cfg = tf.MistralConfig(**{**common, **llama_like, "sliding_window": None, **overrides})
        cls = tf.MistralForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**{**common, **llama_like, **overrides})
        cls = tf.Qwen2ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(SEED)
    model = cls(cfg).float().eval()
    _perturb(model, SEED)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    return model


def save_hf(model: torch.nn.Module, path: Path, **kwargs: Any) -> Path:
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return path


def edit_config(path: Path, **changes: Any) -> Path:
    """Rewrite config.json keys in place (None values are written as JSON null)."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def write_config_only(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path

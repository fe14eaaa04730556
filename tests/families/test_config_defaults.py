"""A config.json key a family's file leaves out takes that family's transformers default
(hand-written or trimmed configs; ``save_pretrained`` writes every key): Gemma 2's
soft-capping, Phi-3's norm epsilon, the Qwen and Mistral windows."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from kvserve.model.hf_import import map_config  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)


def _trimmed(cls: str, drop: tuple[str, ...], **kw) -> dict:
    hf = getattr(transformers, cls)(**SMALL, **kw).to_dict()
    hf["architectures"] = [cls.replace("Config", "ForCausalLM")]
    for k in drop:
        hf.pop(k, None)
    return hf


@pytest.mark.parametrize("cls, drop, kw, want", [
    ("Gemma2Config", ("attn_logit_softcapping", "final_logit_softcapping"), {},
     dict(attn_softcap=50.0, final_softcap=30.0)),
    ("Phi3Config", ("rms_norm_eps",), {}, dict(norm_eps=1e-5)),
    ("Qwen2Config", ("sliding_window", "layer_types"),
     dict(use_sliding_window=True, max_window_layers=0),
     dict(sliding_window=4096)),
    ("MistralConfig", ("sliding_window",), {}, dict(sliding_window=4096)),
    ("LlamaConfig", ("rms_norm_eps",), {}, dict(norm_eps=1e-6)),
], ids=["gemma2-softcaps", "phi3-eps", "qwen2-window", "mistral-window", "llama-eps"])
def test_a_missing_key_takes_the_family_default(cls, drop, kw, want):
    full = map_config(_trimmed(cls, (), **kw))
    cfg = map_config(_trimmed(cls, drop, **kw))
    assert {k: getattr(cfg, k) for k in want} == want
    assert cfg == full  # what transformers reads the trimmed file as

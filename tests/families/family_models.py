"""Tiny random-initialised transformers models, one per family, with each family's special
options switched on (offline, float32), saved as local Hugging Face directories.

Every case has GQA where the family has it, an odd head count or explicit head_dim where
allowed, a generation_config.json with several EOS ids, and (sliding-window families) a
window far shorter than the tests' sequences. Most have head_dim 16 or 32 and export as the
fused graph; ``PORTABLE`` lists those exported portable (LongRoPE; Gemma's head_dim 12).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 320
SEED = 4321
WINDOW = 6  # sliding windows: prompts are up to 12 tokens and decoding runs 64 steps past them
ORIG_MAX = 20  # phi3_longrope's original_max_position_embeddings: crossed while decoding
SPIECE = ("mistral", "gemma", "gemma2", "phi3", "phi3_longrope")  # SentencePiece tokenizers
# exported portable (the others fused): LongRoPE, and Gemma's head_dim 12 (not a multiple of 16)
PORTABLE = ("gemma", "phi3_longrope", "phi3_longrope_short")

_LLAMA = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              initializer_range=0.15)  # livelier than 0.02: greedy text that does not repeat
# head_dim 16 (96 / 6): the fused graph (onnxruntime's GroupQueryAttention on CPU takes multiples
# of 16); _LLAMA's head_dim 8 is for the portable cases (LongRoPE, and Gemma's explicit 12)
_FUSED = dict(_LLAMA, hidden_size=96)
_LONG = [1.0 + 0.5 * i for i in range(4)]
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("Llama", dict(**_FUSED, tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16))),
    "smollm2": ("Llama", dict(**_FUSED, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "smollm3": ("SmolLM3", dict(**_FUSED, tie_word_embeddings=True, no_rope_layers=[1, 0],
                                rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                     factor=2.0),
                                use_sliding_window=False)),
    "qwen2": ("Qwen2", dict(**_FUSED, tie_word_embeddings=False, use_sliding_window=True,
                            sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("Qwen3", dict(**_FUSED, head_dim=32, tie_word_embeddings=True,
                            attention_bias=True)),
    "mistral": ("Mistral", dict(**_FUSED, sliding_window=WINDOW, tie_word_embeddings=False)),
    "gemma": ("Gemma", dict(**{**_LLAMA, "num_key_value_heads": 1}, head_dim=12,
                            hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2", dict(**_FUSED, head_dim=32, sliding_window=WINDOW,
                              query_pre_attn_scalar=20, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0)),
    "phi3": ("Phi3", dict(**_FUSED, sliding_window=WINDOW * 2)),
    # LongRoPE: the prompts (3 to 12 tokens) are short, and every row crosses
    # original_max_position_embeddings (ORIG_MAX) while decoding, each at its own step;
    # Score's long sequence is long from the start
    "phi3_longrope": ("Phi3", dict(**{**_LLAMA, "num_key_value_heads": 6},
                                   sliding_window=WINDOW,
                                   original_max_position_embeddings=ORIG_MAX,
                                   rope_parameters=dict(rope_type="longrope",
                                                        rope_theta=10000.0,
                                                        original_max_position_embeddings=ORIG_MAX,
                                                        short_factor=[1.0, 1.0, 1.5, 2.0],
                                                        long_factor=_LONG))),
    # ... and one whose sequences stay below it (the short factors)
    "phi3_longrope_short": ("Phi3", dict(**{**_LLAMA, "num_key_value_heads": 6},
                                         original_max_position_embeddings=128,
                                         rope_parameters=dict(rope_type="longrope",
                                                              rope_theta=10000.0,
                                                              original_max_position_embeddings=128,
                                                              short_factor=[1.0, 1.0, 1.5, 2.0],
                                                              long_factor=_LONG))),
}


PROMPT = [11, 40, 7, 93, 150, 21, 64, 33, 12, 200, 17, 81]  # 12 tokens: past every window


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own cached greedy generate: n tokens and the logits of each step."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0, output_logits=True,
                      return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0] for s in out.logits]


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0; perturb every tensor so that a wrong mapping
    of any of them shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def build(name: str) -> torch.nn.Module:
    import transformers as tf

    family, kw = CASES[name]
    cfg = getattr(tf, family + "Config")(**kw, attn_implementation="eager")
    torch.manual_seed(SEED)
    model = getattr(tf, family + "ForCausalLM")(cfg).float().eval()
    _perturb(model, SEED)
    return model


def save(model: torch.nn.Module, path: Path, tokenizer_json: str | None = None,
         eos: list[int] | None = None) -> Path:
    """The HF directory; generation_config.json lists ``eos`` (several ids, as Llama 3's)."""
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": eos or [5, 6, 7], "do_sample": True,
         "temperature": 0.6, "top_p": 0.9}))
    if tokenizer_json is not None:
        (path / "tokenizer.json").write_text(tokenizer_json)
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    return path


def sentencepiece_tokenizer(texts: list[str], vocab_size: int = VOCAB) -> str:
    """A Llama-2-style tokenizer.json: BPE with byte fallback (``<0xNN>`` tokens in the model
    vocabulary), Metaspace pre-tokenizer, Replace/ByteFallback/Fuse/Strip decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"]
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    base.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size - 256, special_tokens=specials, limit_alphabet=30,
        show_progress=False))
    spec = json.loads(base.to_str())
    learned = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
               if t not in specials]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)]
                                         + learned)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in spec["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size() <= vocab_size
    return tok.to_str()

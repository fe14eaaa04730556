"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``), saved as one ``tokenizer.json``.

No torch here: the server, which has no torch, uses the same class.

Byte level means every byte has a token (``initial_alphabet=ByteLevel.alphabet()``), there is no
normalizer and no prefix space, so ``decode(encode(text)) == text`` for any UTF-8 string.
Special tokens: ``<|endoftext|>`` (end of text, joins documents in training), ``<|pad|>``, and
ChatML's ``<|im_start|>`` / ``<|im_end|>``, reserved so that every trained model can be served
with a chat template (``chat_config``: the ``tokenizer_config.json`` a checkpoint carries).
Decoding keeps special tokens, so a literal ``<|endoftext|>`` in the input also round-trips.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, PAD, IM_START, IM_END)
# ChatML (as Qwen and SmolLM write it): each message is <|im_start|>ROLE\nCONTENT<|im_end|>\n and
# the answer opens with <|im_start|>assistant\n; <|im_end|> is the template's eos_token, so the
# server ends an answer there (and still at <|endoftext|>, the model's eos).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> "Tokenizer":
    """Train a byte-level BPE on an iterator of texts (deterministic for the same input)."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} (256 bytes + special tokens), "
                         f"got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out = Tokenizer(tok)
    log.info("trained byte-level BPE: %d tokens (asked for %d)", out.vocab_size, vocab_size)
    return out


class Tokenizer:
    """Thin wrapper: ids are plain Python ints; decoding is exact and keeps special tokens."""

    def __init__(self, tok: HFTokenizer):
        self._tok = tok
        # Tokenizers trained here always have both; an imported model's tokenizer may not
        # (Llama's has </s> and no pad): then the model config's eos/pad ids are the truth.
        self.eos_id: int | None = tok.token_to_id(EOS)
        self.pad_id: int | None = tok.token_to_id(PAD)

    def chat_config(self) -> dict | None:
        """The ``tokenizer_config.json`` of a model with this tokenizer: the ChatML template and
        its special tokens; None when the tokenizer lacks ``<|im_start|>`` / ``<|im_end|>``
        (one trained before they were reserved, or a foreign one)."""
        if self.token_to_id(IM_START) is None or self.token_to_id(IM_END) is None:
            return None
        return {"chat_template": CHATML_TEMPLATE, "eos_token": IM_END, "pad_token": PAD,
                "additional_special_tokens": [IM_START, IM_END]}

    def require_special_tokens(self) -> "Tokenizer":
        if self.eos_id is None or self.pad_id is None:
            raise ValueError(f"tokenizer lacks the special tokens {EOS!r} / {PAD!r}")
        return self

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        return cls(HFTokenizer.from_file(str(path)))

    @classmethod
    def from_str(cls, s: str) -> "Tokenizer":
        return cls(HFTokenizer.from_str(s))

    def to_str(self) -> str:
        return self._tok.to_str()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_str())

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens=True`` runs the tokenizer's post-processor (e.g. Llama's and
        Gemma's BOS), as transformers' ``tokenizer(text)`` does; False (training, chat
        renderings that write their own BOS) encodes the text alone."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str],
                     add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts),
                                                      add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

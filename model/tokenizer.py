"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``), saved as one ``tokenizer.json``.

No torch here: the server, which has no torch, uses the same class.

Byte level means every byte has a token (``initial_alphabet=ByteLevel.alphabet()``), there is no
normalizer and no prefix space, so ``decode(encode(text)) == text`` for any UTF-8 string.
Special tokens: ``<|endoftext|>`` (end of text, joins documents in training) and ``<|pad|>``.
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
SPECIAL_TOKENS = (EOS, PAD)
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

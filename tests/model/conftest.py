"""Fixtures for the model tests: tiny corpora written into tmp dirs, a tiny trained tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\n\nprint(os.path.join('a', 'b'))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "# comment: naïve café, 日本語, emoji 😀\nvalue = {'key': [1, 2, 3]}\n",
    "while True:\n\tbreak\n",
]


def tiny_documents(n: int = 48) -> list[str]:
    """n small, distinct Python-like documents (deterministic)."""
    return [f"# doc {i}\n" + SNIPPETS[i % len(SNIPPETS)] * (1 + i % 3) for i in range(n)]


def write_tiny_corpus(root: Path, n: int = 48) -> Path:
    """A directory of n .py files, nested one level, plus a JSONL twin of the same texts."""
    root.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(tiny_documents(n)):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"m{i:03d}.py").write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus") / "src")


@pytest.fixture(scope="session")
def tiny_jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("jsonl") / "docs.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i, text in enumerate(tiny_documents()):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_docs() -> list[str]:
    return tiny_documents()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from kvserve.model.tokenizer import train_bpe

    return train_bpe(tiny_documents(), vocab_size=320)

"""Training data: text files / directories / globs / JSONL -> one memory-mapped token file per split.

Pipeline
  resolve_inputs(specs)             paths, directories (recursive), globs -> sorted files
  iter_documents(files, field)      one document per text file, one per JSONL line
  assign_split(docs, fraction)      deterministic by a hash of each document's text
  build_tokens(...)                 tokenize once -> ``train.bin`` / ``val.bin`` (+ ``meta.json``),
                                    documents joined by the eos token, uint16 when vocab < 65536
  BatchSampler                      (x, y) int64 (B, T) batches, a pure function of (seed, step)

Errors a user can cause (missing path, empty input, unreadable or non-UTF-8 file, bad JSONL) are
raised as FileNotFoundError / ValueError with a message that names the file (and line).
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
SKIP_DIR_NAMES = {"__pycache__"}
ENCODE_CHUNK = 256  # documents per encode_batch call
META = "meta.json"


# --- inputs ---------------------------------------------------------------------------------
def _has_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


def _walk(directory: Path) -> list[Path]:
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIR_NAMES)
        out.extend(Path(root) / f for f in sorted(files) if not f.startswith("."))
    return sorted(out)


def resolve_inputs(specs: Sequence[str | Path]) -> list[Path]:
    """Files, directories (recursive; hidden entries and __pycache__ skipped) and globs
    (``**`` allowed) -> a sorted, de-duplicated list of files."""
    if not specs:
        raise ValueError("no training data given")
    files: list[Path] = []
    for spec in specs:
        s = str(spec)
        if _has_magic(s) and not Path(s).exists():
            matches = sorted(Path(m) for m in glob.glob(s, recursive=True))
            found = [p for m in matches for p in ([m] if m.is_file() else
                                                  _walk(m) if m.is_dir() else [])]
            if not found:
                raise FileNotFoundError(f"no files match {s!r}")
            files.extend(found)
            continue
        p = Path(s)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = _walk(p)
            if not found:
                raise ValueError(f"directory {p} contains no files")
            files.extend(found)
        else:
            raise FileNotFoundError(f"training data not found: {p}")
    seen: set[Path] = set()
    unique = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return sorted(unique)


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 (byte offset {e.start}); training data "
                         f"must be UTF-8 text") from None


def iter_documents(files: Iterable[Path], text_field: str = "text") -> Iterator[str]:
    """Yields the non-empty documents: a whole text file, or each JSONL line's ``text_field``."""
    for path in files:
        text = _read_text(path)
        if path.suffix.lower() not in JSONL_SUFFIXES:
            if text:
                yield text
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or text_field not in rec:
                raise ValueError(f"{path}:{lineno}: no {text_field!r} field (use --text-field "
                                 f"to choose another)")
            value = rec[text_field]
            if not isinstance(value, str):
                raise ValueError(f"{path}:{lineno}: field {text_field!r} is "
                                 f"{type(value).__name__}, expected a string")
            if value:
                yield value


def fingerprint(files: Sequence[Path], text_field: str, val_fraction: float) -> str:
    """Identifies the input (paths, sizes, mtimes, options) for caching the tokenized data."""
    h = hashlib.sha256(json.dumps([text_field, val_fraction]).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


# --- split ----------------------------------------------------------------------------------
def doc_hash_unit(text: str) -> float:
    """A document's position in [0, 1) from the sha256 of its text (same text, same split)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def assign_split(units: Sequence[float], val_fraction: float) -> list[bool]:
    """True = validation. Documents with hash unit < val_fraction; at least one document on
    each side when there are two or more (the lowest / highest hash moves)."""
    is_val = [u < val_fraction for u in units]
    n = len(units)
    if n >= 2 and val_fraction > 0:
        if not any(is_val):
            is_val[min(range(n), key=lambda i: units[i])] = True
        if all(is_val):
            is_val[max(range(n), key=lambda i: units[i])] = False
    return is_val


# --- token files ----------------------------------------------------------------------------
def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 2 ** 16 else np.dtype(np.uint32)


@dataclass
class TokenData:
    train: np.ndarray  # (N_train,) memmap
    val: np.ndarray  # (N_val,) memmap
    meta: dict


def _docs_by_split(files: Sequence[Path], text_field: str, is_val: Sequence[bool],
                   want_val: bool) -> Iterator[str]:
    for i, doc in enumerate(iter_documents(files, text_field)):
        if is_val[i] == want_val:
            yield doc


def split_units(files: Sequence[Path], text_field: str) -> list[float]:
    """First pass over the input: one hash unit per document; raises on empty input."""
    units = [doc_hash_unit(d) for d in iter_documents(files, text_field)]
    if not units:
        raise ValueError(f"no text found in the training data ({len(files)} file(s), all empty)")
    return units


def train_documents(files: Sequence[Path], text_field: str, val_fraction: float
                    ) -> Callable[[], Iterator[str]]:
    """An iterator factory over the training-split documents (for the tokenizer)."""
    units = split_units(files, text_field)
    is_val = assign_split(units, val_fraction)
    if len(units) == 1:
        is_val = [False]
    return lambda: _docs_by_split(files, text_field, is_val, want_val=False)


def _write_stream(docs: Iterable[str], tok: Tokenizer, path: Path, dtype: np.dtype) -> int:
    """Tokenize documents in chunks, each followed by eos, appended to a raw token file."""
    n = 0
    with path.open("wb") as f:
        chunk: list[str] = []

        def flush() -> int:
            ids = [i for row in tok.encode_batch(chunk) for i in (*row, tok.eos_id)]
            np.asarray(ids, dtype=dtype).tofile(f)
            chunk.clear()
            return len(ids)

        for doc in docs:
            chunk.append(doc)
            if len(chunk) >= ENCODE_CHUNK:
                n += flush()
        if chunk:
            n += flush()
    return n


def build_tokens(files: Sequence[Path], tok: Tokenizer, out_dir: Path, text_field: str = "text",
                 val_fraction: float = 0.05) -> TokenData:
    """Tokenize once into ``out_dir`` (written to a temp dir, then renamed); reused if present."""
    out_dir = Path(out_dir)
    if (out_dir / META).is_file():
        return open_tokens(out_dir)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    units = split_units(files, text_field)
    is_val = assign_split(units, val_fraction)
    dtype = token_dtype(tok.vocab_size)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        if len(units) == 1:  # one document: its last val_fraction of tokens is validation
            n = _write_stream(iter_documents(files, text_field), tok, tmp / "all.bin", dtype)
            allt = np.fromfile(tmp / "all.bin", dtype=dtype)
            cut = max(1, min(n - 1, int(round(n * (1.0 - val_fraction)))))
            allt[:cut].tofile(tmp / "train.bin")
            allt[cut:].tofile(tmp / "val.bin")
            (tmp / "all.bin").unlink()
            n_train, n_val = cut, n - cut
        else:
            n_train = _write_stream(_docs_by_split(files, text_field, is_val, False), tok,
                                    tmp / "train.bin", dtype)
            n_val = _write_stream(_docs_by_split(files, text_field, is_val, True), tok,
                                  tmp / "val.bin", dtype)
        meta = {"dtype": dtype.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                "n_train": n_train, "n_val": n_val, "n_docs": len(units),
                "n_val_docs": sum(is_val) if len(units) > 1 else 0,
                "val_fraction": val_fraction, "n_files": len(files), "text_field": text_field}
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another process finished first: use its (identical) result
            if not (out_dir / META).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    data = open_tokens(out_dir)
    log.info("tokenized %d documents (%d validation): %d train / %d validation tokens (%s)",
             meta["n_docs"], meta["n_val_docs"], n_train, n_val, dtype.name)
    return data


def open_tokens(out_dir: Path) -> TokenData:
    meta = json.loads((Path(out_dir) / META).read_text())
    dtype = np.dtype(meta["dtype"])

    def mm(name: str, n: int) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(Path(out_dir) / name, dtype=dtype, mode="r", shape=(n,))

    return TokenData(mm("train.bin", meta["n_train"]), mm("val.bin", meta["n_val"]), meta)


# --- statistics -----------------------------------------------------------------------------
def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats/token) of the split's own token frequencies: the loss of a model that
    knows only how often each token occurs (an optimistic unigram baseline)."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# --- batches --------------------------------------------------------------------------------
class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens; a pure function of (seed, step).

    The global batch of a step has ``batch_size * grad_accum * world_size`` rows, drawn once
    from ``numpy.random.default_rng([seed, step])``. Micro-step ``m`` of rank ``r`` takes rows
    ``[(m * world_size + r) * batch_size, ... + batch_size)``, so 2 ranks with batch b see
    exactly the rows 1 process with batch 2b sees, and resuming at a step is exact.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 grad_accum: int = 1, world_size: int = 1, rank: int = 0):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"the training split has {len(tokens)} tokens, fewer than "
                             f"seq_len + 2 = {seq_len + 2}: add data or lower --seq-len")
        self.tokens, self.B, self.T, self.seed = tokens, batch_size, seq_len, seed
        self.accum, self.world, self.rank = grad_accum, world_size, rank
        self.global_rows = batch_size * grad_accum * world_size

    def starts(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.T - 1, size=self.global_rows)  # (G,)

    def micro_batch(self, step: int, micro: int):
        s = self.starts(step)
        row0 = (micro * self.world + self.rank) * self.B
        return windows(self.tokens, s[row0:row0 + self.B], self.T)


def windows(tokens: np.ndarray, starts: np.ndarray, T: int):
    """(x, y) int64 tensors (B, T): y is x shifted by one token."""
    import torch

    idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(T + 1)  # (B, T+1)
    w = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))  # (B, T+1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (B, T), (B, T)


def eval_starts(n_tokens: int, seq_len: int, n_rows: int) -> np.ndarray:
    """Fixed validation windows: evenly spread over the split, the same every evaluation."""
    if n_tokens < seq_len + 1:
        raise ValueError(f"the validation split has {n_tokens} tokens, fewer than seq_len + 1 "
                         f"= {seq_len + 1}: add data, raise --val-fraction or lower --seq-len")
    last = n_tokens - seq_len - 1
    n_rows = max(1, n_rows)
    if n_rows == 1:
        return np.zeros(1, dtype=np.int64)
    return np.floor(np.linspace(0, last, n_rows)).astype(np.int64)  # (n_rows,)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))

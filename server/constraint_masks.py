"""A step's masks for the constrained rows of a batch, computed in parallel by llguidance's
executor (Rust threads, GIL released), optionally on a background thread while onnxruntime
runs the step: ``start(rows)`` before the model call, ``wait()`` after it, then ``apply``.

Rows are ``(batch_row_index, Constraint)``; rows not listed stay unconstrained (their mask
words are all ones and ``apply`` leaves their logits untouched), so constrained and free rows
share a batch.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import llguidance as llg
import llguidance.numpy as lln
import numpy as np

from .constraints import Constraint, apply_bitmask

Rows = Sequence[tuple[int, Constraint]]


class MaskBatch:
    def __init__(self, vocab_size: int, max_rows: int, threads: int | None = None):
        self.vocab_size, self.max_rows = int(vocab_size), int(max_rows)
        self.mask = lln.allocate_token_bitmask(self.max_rows, self.vocab_size)
        self.executor = llg.LLExecutor(threads)
        self._bg: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._filled: list[int] = []

    def fill(self, rows: Rows) -> np.ndarray:
        """Compute the listed rows' masks (in parallel) into ``self.mask``; returns it."""
        for i in self._filled:
            self.mask[i] = -1
        idx = [int(i) for i, _ in rows]
        if any(not 0 <= i < self.max_rows for i in idx) or len(set(idx)) != len(idx):
            raise ValueError(f"mask rows must be distinct and in [0, {self.max_rows}): {idx}")
        if rows:
            lln.fill_next_token_bitmask_par(self.executor,
                                            [(c.matcher, int(i)) for i, c in rows], self.mask)
        self._filled = idx
        return self.mask

    def start(self, rows: Rows) -> None:
        """``fill(rows)`` on a background thread (call ``wait`` before reading the masks)."""
        if self._pending is not None:
            raise RuntimeError("a mask computation is already in flight: wait() for it first")
        if self._bg is None:
            self._bg = ThreadPoolExecutor(1, thread_name_prefix="kvserve-masks")
        self._pending = self._bg.submit(self.fill, list(rows))

    def wait(self) -> np.ndarray:
        if self._pending is None:
            raise RuntimeError("no mask computation in flight (start(rows) first)")
        fut, self._pending = self._pending, None
        return fut.result()

    def apply(self, logits: np.ndarray, rows: Rows) -> None:
        """Mask the listed rows of ``logits`` (batch, vocab) in place with the filled masks."""
        for i, _ in rows:
            apply_bitmask(logits[i:i + 1], self.mask[i:i + 1])

    def close(self) -> None:
        if self._bg is not None:
            self._bg.shutdown(wait=True)
            self._bg = None

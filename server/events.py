"""Engine -> caller events, with the caller woken in batches.

A thread blocked on a queue is woken by every ``put``. On a small machine that wake-up is the
engine's largest per-token cost: the caller's thread needs a core while onnxruntime's threads
hold them: measured on the 2-core bench machine (6M model, batch 1, interleaved in one
process) the engine ran at 0.76x the raw runner loop with a wake-up per token and 0.90x with no
caller at all. ``EventChannel`` separates handing an event over
(``stage``: appended, visible to a caller that looks, no wake-up) from waking the caller
(``wake``); the engine wakes each caller at most once per ``stream_interval`` (and at once for
a first token and for the end), so a fast model's tokens reach a streaming caller in small
bursts instead of one wake-up each. ``put`` is both at once, as ``queue.SimpleQueue.put``.
"""
from __future__ import annotations

import collections
import queue
import threading
import time


class EventChannel:
    """A single-consumer event queue (``get`` / ``get_nowait`` raise ``queue.Empty`` as
    ``queue.SimpleQueue``'s) whose producer decides when the consumer is woken."""

    __slots__ = ("_items", "_ready")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._ready = threading.Event()

    def stage(self, ev) -> None:
        """Hand ``ev`` over without waking the consumer (it sees it when it next looks)."""
        self._items.append(ev)

    def wake(self) -> None:
        self._ready.set()

    def put(self, ev) -> None:
        self._items.append(ev)
        self.wake()

    def get_nowait(self):
        try:
            return self._items.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, block: bool = True, timeout: float | None = None):
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._items.popleft()
            except IndexError:
                pass
            if not block:
                raise queue.Empty
            self._ready.clear()
            try:  # an event staged and woken between the look above and the clear
                return self._items.popleft()
            except IndexError:
                pass
            left = None if end is None else end - time.monotonic()
            if (left is not None and left <= 0) or not self._ready.wait(left):
                raise queue.Empty

    def empty(self) -> bool:
        return not self._items

"""The server's serving state, shared by the gRPC servicer and the HTTP API: ready after
warm-up, draining after SIGTERM, and the model calls in flight. ``gate`` is the one readiness
check both wires answer with (``UNAVAILABLE`` / HTTP 503)."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

from .domain import Unavailable


@dataclass
class ServingState:
    """Set by the app: ``ready`` after warm-up, ``draining`` after SIGTERM. ``inflight``
    counts the model calls (Generate, Score) in progress, so a drain knows when it is done."""
    ready: bool = False
    draining: bool = False
    info: dict = field(default_factory=dict)
    inflight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def gate(self) -> None:
        """Raise ``Unavailable`` unless the server takes model calls now."""
        if self.draining:
            raise Unavailable("the server is shutting down; retry on another replica")
        if not self.ready:
            raise Unavailable("the model is still loading; retry shortly")

    @contextlib.contextmanager
    def call(self):
        with self._lock:
            self.inflight += 1
        try:
            yield
        finally:
            with self._lock:
                self.inflight -= 1

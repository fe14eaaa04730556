"""The engine's seams, declared: what it needs of a model runner, of that runner's KV cache, of
an event sink and of a metrics sink. ``kvserve.artifact``'s ``FusedLM`` (``DeviceKV``) and
``PortableLM`` (``KVBuffers``) implement the runner and the cache; the test fakes
(``tests/fake_lm.py``) do too; ``server.events.EventChannel`` is the staged sink;
``server.metrics.Metrics`` the metrics sink. Structural (``typing.Protocol``): nothing inherits.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class KVCache(Protocol):
    """Per-slot K/V rows of up to ``max_batch`` sequences. Active sequences occupy slots
    0..n-1; ``used[b]`` rows of slot b are filled (row index == position). A free slot keeps
    ``retained[b]`` rows of the sequence that left it (``retain``) until a sequence takes it
    (``reuse``: those rows, or none) or a ``move`` overwrites it (the engine uses this with
    its prefix cache only: ``server.slot_rows``)."""
    capacity: int
    used: np.ndarray
    retained: np.ndarray

    def ensure_capacity(self, needed: int) -> None: ...
    def reserve(self, rows: int) -> None: ...
    def shrink_to_fit(self, n: int, keep_rows: int = 0) -> None: ...
    def move(self, src: int, dst: int) -> None: ...
    def retain(self, slot: int, rows: int) -> None: ...
    def reuse(self, slot: int, rows: int) -> None: ...


@runtime_checkable
class Runner(Protocol):
    """A model run by onnxruntime (or a fake): calls on slots of its own ``KVCache``."""
    cfg: Any  # kvserve.model.config.ModelConfig

    @property
    def last_rows(self) -> bool:
        """``prefill(last=True)`` computes the last row's logits alone."""
    @property
    def has_attention(self) -> bool: ...
    @property
    def attention_ready(self) -> bool: ...

    def new_cache(self, max_batch: int) -> KVCache: ...
    def log_softmax(self, rows: np.ndarray) -> np.ndarray: ...

    def prefill(self, kv: KVCache, lo: int, prompts: list, attention: bool = False,
                last: bool = False) -> Any:
        """Prompts into slots lo, lo+1, ...; ``.logits`` per prompt ((T_b, V), or (1, V) with
        ``last``), ``.attention`` per prompt (L, H, T_b, T_b) when asked."""
    def extend(self, kv: KVCache, slot: int, tokens: Any, rope_length: int | None = None,
               last: bool = False) -> np.ndarray:
        """A chunk of one slot's tokens after its rows so far: logits (T, V) or (1, V)."""
    def decode(self, kv: KVCache, n: int, tokens: Sequence[int], attention: bool = False
               ) -> tuple[np.ndarray, list[np.ndarray] | None]:
        """One token for each of slots 0..n-1: logits (n, V), attention rows when asked."""


@runtime_checkable
class EventSink(Protocol):
    """Where a request's events go; ``put`` hands one over and wakes the consumer."""

    def put(self, ev: Any) -> None: ...


@runtime_checkable
class StagedSink(EventSink, Protocol):
    """A sink that can take events without waking its consumer (``stage``) and be woken later
    (``wake``): streaming callers are woken in rounds (``server.events``)."""

    def stage(self, ev: Any) -> None: ...
    def wake(self) -> None: ...


def is_staged_sink(sink: Any) -> bool:
    """``isinstance(sink, StagedSink)`` in ~0.2 us: the runtime Protocol check walks the
    protocol's members on every call (10-17 us, paid at each admission)."""
    return all(callable(getattr(sink, m, None)) for m in ("put", "stage", "wake"))


class EngineMetrics(Protocol):
    """The hooks the engine calls (``server.metrics.Metrics``)."""

    def queue_depth(self, n: int) -> None: ...
    def running(self, n: int) -> None: ...
    def admitted(self, queue_seconds: float, prompt_tokens: int) -> None: ...
    def token(self, first: bool, seconds: float) -> None: ...
    def finished(self, reason: str, generated: int) -> None: ...
    def step(self, batch: int, seconds: float) -> None: ...
    def prefix_hit(self, tokens: int) -> None: ...
    def speculated(self, drafted: int, accepted: int) -> None: ...
    def fast_forwarded(self, tokens: int) -> None: ...
    def iteration_failed(self, restarted: int) -> None: ...


class NullMetrics(EngineMetrics):
    """``EngineMetrics`` that records nothing (tests, the bench): the protocol's own empty
    methods."""

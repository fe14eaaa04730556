"""A request's state inside the engine: the caller's ``Handle`` and the engine's ``Sequence``
(one per generation request) and ``ScoreJob`` (one per Score call)."""
from __future__ import annotations

import collections
import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .detok import IncrementalDetokenizer, StopMatcher
from .domain import FinishEvent, GenerateRequest, ScoreRequest, TokenEvent
from .events import EventChannel
from .stopping import QuietRule


class Handle:
    """The caller's side of one request: events arrive on ``events``; ``cancel()`` any time."""

    def __init__(self, request_id: str, wake: Callable[[], None], events=None):
        self.request_id = request_id
        # an EventChannel, or any EventSink (a StagedSink to be woken in rounds), for the
        # engine thread (the HTTP API's asyncio bridge)
        self.events = EventChannel() if events is None else events
        self._wake = wake
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._wake()

    def __iter__(self) -> Iterator[TokenEvent | FinishEvent]:
        """Blocking iteration until the FinishEvent (for in-process use and tests)."""
        while True:
            ev = self.events.get()
            yield ev
            if isinstance(ev, FinishEvent):
                return


@dataclass(eq=False)
class Sequence:
    """One generation request in the engine. Its KV slot is its index in the scheduler's
    ``active`` list."""
    req: GenerateRequest
    handle: Handle
    submitted: float
    admitted: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    seed: int | None = None  # what its sampled steps draw with (model.sampling); None: greedy
    generated: list[int] = field(default_factory=list)
    forced: collections.deque = field(default_factory=collections.deque)  # prompt tail to feed
    feed: int = 0  # the token fed in the next decode step
    text: list[str] = field(default_factory=list)
    detok: IncrementalDetokenizer | None = None
    stopper: StopMatcher | None = None
    done: bool = False
    # from which generated-token index the batch's greedy argmax picks this sequence's token
    # (stopping.argmax_from); None: never (it samples or penalises)
    argmax_from: int | None = None
    staged: bool = False  # its events box can hold events back (a StagedSink)
    quiet: QuietRule | None = None  # when a step may only record the token (stopping.py)
    held: list = field(default_factory=list)  # (token, time) chosen, not yet made events
    drafting: Any = None  # speculation.Drafting where it may draft
    cached_tokens: int = 0  # prompt tokens whose KV rows came from the prefix cache (pool or slot)
    # drafted tokens copied from its lookup ids (a prediction) that verification kept / threw
    # away (OpenAI's accepted / rejected prediction tokens)
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    restarts: int = 0  # times it was re-admitted after a failed engine iteration (resume.py)
    # what prefill feeds (the prompt; a resumed request's delivered tokens after it) and the
    # index of the first token this call generates (server.resume)
    prefill_ids: list[int] = field(default_factory=list)
    first_index: int = 0
    # a resumed request's delivered tokens, fed after its prompt one decode step each, as the
    # earlier call fed them, where a prefill would make their rows differently
    # (server.rounding); empty: they are prefilled with the prompt (``prefill_ids``)
    replay: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prefill_ids:
            self.prefill_ids = self.req.prompt_ids

    @property
    def wants_attention(self) -> bool:
        return self.req.output.attention

    def rows(self, max_seq_len: int) -> int:
        """KV rows it may fill: its prompt and new tokens, within the model's context."""
        return min(len(self.req.prompt_ids) + self.req.stopping.max_new_tokens + 1,
                   max_seq_len + 1)

    def tokens(self) -> list[int]:
        """Its tokens so far: prompt, then generated."""
        return [*self.req.prompt_ids, *self.generated]


@dataclass(eq=False)
class ScoreJob:
    req: ScoreRequest
    handle: Handle
    future: concurrent.futures.Future
    steps: Iterator[None] | None = None  # scoring.score_steps

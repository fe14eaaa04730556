"""Domain types shared by the engine, validation and the servicer. Nothing here knows gRPC."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvserve.model.sampling import SamplingParams


# --- errors (the servicer maps each to one status code) ------------------------------------------
class ServingError(Exception):
    """Base of the errors a caller may see; the message says what the caller did wrong.
    ``field``: the request field it is about, where one is (HTTP reports it as ``param``)."""

    def __init__(self, message: str = "", field: str | None = None):
        super().__init__(message)
        self.field = field


class InvalidArgument(ServingError):
    pass


class QueueFull(ServingError):
    pass


class Unavailable(ServingError):
    pass


class Unimplemented(ServingError):
    pass


class FailedPrecondition(ServingError):
    """The request is fine but this server cannot do it: the model lacks what it needs (a
    tokenizer for text, a usable chat template for chat)."""


# --- requests -----------------------------------------------------------------------------------
class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    STOP_TOKEN = "stop_token"
    CANCELLED = "cancelled"
    TIME_LIMIT = "time_limit"
    ERROR = "error"
    CONSTRAINT = "constraint"  # the output is complete for its grammar (nothing may follow)


@dataclass(frozen=True)
class StopParams:
    max_new_tokens: int
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class OutputParams:
    logprobs: bool = False
    top_logprobs: int = 0
    return_logits: bool = False
    attention_layers: tuple[int, ...] = ()
    attention_heads: tuple[int, ...] = ()  # resolved: never empty when layers are set

    @property
    def attention(self) -> bool:
        return bool(self.attention_layers)


@dataclass
class GenerateRequest:
    """A validated generation request."""
    prompt_ids: list[int]
    sampling: SamplingParams
    stopping: StopParams
    output: OutputParams
    request_id: str = ""
    deadline: float | None = None  # time.monotonic() after which the work stops
    # the tokens an earlier call of this request delivered: it continues after them
    # (server.resume)
    resume: tuple[int, ...] = ()
    # a constraints.Constraint: the sequence's own grammar matcher (None: unconstrained)
    constraint: Any = None
    # tokens the output is expected to repeat (OpenAI's ``prediction``): n-gram drafts are
    # looked up in them too (server.speculation); not model input, no effect on the output
    lookup_ids: tuple[int, ...] = ()


@dataclass
class ScoreRequest:
    sequences: list[list[int]]
    top_logprobs: int = 0
    request_id: str = ""
    deadline: float | None = None


# --- results ------------------------------------------------------------------------------------
@dataclass(slots=True)  # one per generated token: slots make it cheaper to build and hold
class TokenEvent:
    index: int
    token_id: int
    text: str
    logprob: float | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    logits: np.ndarray | None = None  # (V,) float32
    attention: Sequence[tuple[int, int, np.ndarray]] = ()  # (layer, head, row) when asked
    special: bool = False


@dataclass
class Timings:
    queue: float = 0.0
    ttft: float = 0.0
    total: float = 0.0


@dataclass
class FinishEvent:
    reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    text: str
    timings: Timings
    stop_sequence: str = ""
    stop_token_id: int | None = None
    error: str = ""
    cached_tokens: int = 0  # prompt tokens whose KV rows came from the prefix cache (pool or slot)
    # drafted tokens copied from the request's lookup ids (a prediction) that verification
    # kept / threw away (both 0 where nothing was drafted from them)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass
class ScoredSequence:
    token_count: int
    ids: np.ndarray  # (T-1,) the scored tokens (ids[1:])
    logprobs: np.ndarray  # (T-1,) float32
    top_ids: np.ndarray | None = None  # (T-1, n)
    top_logprobs: np.ndarray | None = None  # (T-1, n)
    cached_tokens: int = 0  # tokens whose rows and logprobs came from the prefix cache

    @property
    def sum(self) -> float:
        return float(np.sum(self.logprobs, dtype=np.float64))

    @property
    def mean(self) -> float:
        return self.sum / len(self.logprobs) if len(self.logprobs) else 0.0

    @property
    def perplexity(self) -> float:
        return float(np.exp(-self.mean)) if len(self.logprobs) else 1.0

"""What the clients send and what they get back, as pure functions: requests built from
keyword options, server messages parsed into typed results. ``Client`` and ``AsyncClient``
(``client.py``) both call these and keep only their transport (channel, retries, streaming).

No grpc import here (protobuf messages only).

Score semantics (the server's): a sequence of T tokens yields T-1 scored tokens; ``tokens[i]``
is ``log p(token i+1 | tokens 0..i)``. The first token has no context and is not scored, and the
server prepends no BOS. ``sum_logprob``/``mean_logprob``/``perplexity`` are over the T-1 scored
tokens (a 1-token sequence: sum 0, mean 0, perplexity 1).
"""
from __future__ import annotations

import json

import math
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from kvserve.v1 import inference_pb2 as pb

from .common import UINT32_MAX, UINT64_MAX

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: "unspecified",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS_TOKEN: "eos_token",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
    pb.FINISH_REASON_STOP_TOKEN: "stop_token",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_TIME_LIMIT: "time_limit",
    pb.FINISH_REASON_ERROR: "error",
    pb.FINISH_REASON_CONSTRAINT: "constraint",
}


# --- results --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TopLogprob:
    id: int
    logprob: float
    text: str


@dataclass(frozen=True)
class AttentionRow:
    layer: int
    head: int
    weights: list[float]  # over every position so far: prompt, then generated tokens


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (a ``TokenChunk``)."""
    index: int
    id: int
    text: str  # the new text (may be "" while bytes/stop-string prefixes are held back)
    logprob: float | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)
    logits: list[float] | None = None
    attention: list[AttentionRow] = field(default_factory=list)
    special: bool = False

    type = "token"


@dataclass(frozen=True)
class Timings:
    queue_seconds: float
    time_to_first_token_seconds: float
    total_seconds: float


@dataclass(frozen=True)
class Completion:
    """The end of a Generate stream (``Complete``), plus the tokens when collected by
    :meth:`Client.generate`."""
    text: str
    finish_reason: str  # length, eos_token, stop_sequence, stop_token, cancelled, time_limit, error
    stop_sequence: str
    stop_token_id: int | None
    prompt_tokens: int
    generated_tokens: int
    timings: Timings
    request_id: str
    error: str = ""
    tokens: list[TokenEvent] = field(default_factory=list)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV rows came from the prefix cache
    # drafted tokens copied from the request's prediction that verification kept / threw away
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    type = "complete"


GenerateEvent = Union[TokenEvent, Completion]


@dataclass(frozen=True)
class ScoredToken:
    id: int
    logprob: float  # log p(this token | the tokens before it)
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class ScoreResult:
    """One scored sequence. ``tokens`` has ``token_count - 1`` entries (the first token is not
    scored); sum/mean/perplexity are over those."""
    token_count: int
    tokens: list[ScoredToken]
    sum_logprob: float
    mean_logprob: float
    perplexity: float

    @property
    def scored_tokens(self) -> int:
        return len(self.tokens)

    @property
    def logprobs(self) -> list[float]:
        return [t.logprob for t in self.tokens]


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    max_seq_len: int
    eos_token_id: int | None
    provider: str
    attention_available: bool
    version: str
    manifest_sha256: str
    config_json: str
    limits: dict[str, float]
    chat_template_available: bool = False
    eos_token_ids: tuple[int, ...] = ()


# --- parsing -----------------------------------------------------------------------------------
def tops(xs) -> list[TopLogprob]:
    return [TopLogprob(t.id, t.logprob, t.text) for t in xs]


def token_event(c: pb.TokenChunk, logprobs: bool) -> TokenEvent:
    # (each repeated field is looked at once and walked only when set: a plain token's event
    # costs half as much, ~4 us; a stream of 3,000 tokens/s pays it for each)
    top, logits, attention = c.top_logprobs, c.logits, c.attention
    return TokenEvent(
        index=c.index, id=c.id, text=c.text, logprob=c.logprob if logprobs else None,
        top_logprobs=tops(top) if len(top) else [],
        logits=list(logits) if len(logits) else None,
        attention=[AttentionRow(a.layer, a.head, list(a.weights)) for a in attention]
        if len(attention) else [],
        special=c.special)


def completion(c: pb.Complete) -> Completion:
    reason = FINISH_REASONS.get(c.finish_reason, str(c.finish_reason))
    return Completion(
        text=c.text, finish_reason=reason, stop_sequence=c.stop_sequence,
        stop_token_id=c.stop_token_id if reason == "stop_token" else None,
        prompt_tokens=c.prompt_tokens, generated_tokens=c.generated_tokens,
        timings=Timings(c.timings.queue_seconds, c.timings.time_to_first_token_seconds,
                        c.timings.total_seconds),
        request_id=c.request_id, error=c.error, cached_prompt_tokens=c.cached_prompt_tokens,
        accepted_prediction_tokens=c.accepted_prediction_tokens,
        rejected_prediction_tokens=c.rejected_prediction_tokens)


def generate_events(msg: pb.GenerateResponse, logprobs: bool) -> list[GenerateEvent]:
    """The events of one stream message: its token and the tokens coalesced with it
    (``more``), or the stream's end."""
    if msg.HasField("chunk"):
        return [token_event(msg.chunk, logprobs), *(token_event(m, logprobs) for m in msg.more)]
    return [completion(msg.complete)]


def with_tokens(c: Completion, tokens: list[TokenEvent]) -> Completion:
    return Completion(**{**c.__dict__, "tokens": tokens})


class Collector:
    """Collects a Generate stream into one :class:`Completion` with its tokens: ``add`` each
    event; it returns the completion at the end event, else None."""
    INCOMPLETE = "the stream ended without a Complete event"

    def __init__(self) -> None:
        self.tokens: list[TokenEvent] = []

    def add(self, ev: GenerateEvent) -> Completion | None:
        if isinstance(ev, TokenEvent):
            self.tokens.append(ev)
            return None
        return with_tokens(ev, self.tokens)


def score_results(resp: pb.ScoreResponse) -> list[ScoreResult]:
    return [ScoreResult(s.token_count,
                        [ScoredToken(t.id, t.logprob, tops(t.top_logprobs)) for t in s.tokens],
                        s.sum_logprob, s.mean_logprob, s.perplexity) for s in resp.sequences]


def tokenized(resp: pb.TokenizeResponse) -> list[list[int]]:
    return [list(t.ids) for t in resp.tokens]


def detokenized(resp: pb.DetokenizeResponse) -> list[str]:
    return list(resp.texts)


def model_info(r: pb.ModelInfoResponse) -> ModelInfo:
    limits = {f.name: getattr(r.limits, f.name) for f in r.limits.DESCRIPTOR.fields}
    return ModelInfo(r.vocab_size, r.n_layers, r.n_heads, r.n_kv_heads, r.max_seq_len,
                     None if r.eos_token_id < 0 else r.eos_token_id, r.provider,
                     r.attention_available, r.version, r.manifest_sha256, r.config_json, limits,
                     r.chat_template_available, tuple(r.eos_token_ids))


# --- requests -------------------------------------------------------------------------------------
_UNSIGNED_MAX = {"seed": UINT64_MAX}  # the rest are uint32 fields


def _unsigned(**values) -> None:
    """The unsigned fields' values, each in its range (protobuf would say only "Value out of
    range", naming none)."""
    for name, v in values.items():
        top = _UNSIGNED_MAX.get(name, UINT32_MAX)
        if v is not None and not 0 <= v <= top:
            raise ValueError(f"{name} must be in [0, {top}], got {v}")


def generate_request(prompt: str | Sequence[int] | Sequence[dict], *, temperature: float = 0.0,
                     top_k: int = 0, top_p: float | None = None, min_p: float = 0.0,
                     repetition_penalty: float | None = None, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, seed: int | None = None,
                     max_new_tokens: int = 0, min_new_tokens: int = 0,
                     stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                     ignore_eos: bool = False, logprobs: bool = False, top_logprobs: int = 0,
                     return_logits: bool = False, attention_layers: Sequence[int] = (),
                     attention_heads: Sequence[int] = (), request_id: str = "",
                     coalesce: bool = True, json_schema: dict | str | None = None,
                     json_object: bool = False, regex: str | None = None,
                     choice: Sequence[str] | None = None,
                     grammar: str | None = None,
                     prediction: str | Sequence[int] | None = None) -> pb.GenerateRequest:
    """Build a ``GenerateRequest``. ``prompt``: text, token ids, or chat messages (dicts with
    ``role`` and ``content``, rendered by the server with the model's chat template). ``None``
    leaves an optional field unset (the server's default); ``max_new_tokens=0`` is the server
    default. ``coalesce``: tokens ready together may share one message (the client unpacks
    them; an older server ignores it). At most one constraint: ``json_schema`` (a dict or its
    JSON text), ``json_object``, ``regex``, ``choice`` (a list of strings) or ``grammar``
    (Lark): the output then validates against it. ``prediction`` (text or token ids): what the
    output is expected to repeat (a file being edited): speculative decoding drafts from it,
    the output is the same with or without it."""
    _unsigned(top_k=top_k, seed=seed, max_new_tokens=max_new_tokens,
              min_new_tokens=min_new_tokens, top_logprobs=top_logprobs)
    _unsigned(**{f"stop_token_ids[{i}]": v for i, v in enumerate(stop_token_ids)},
              **{f"attention_layers[{i}]": v for i, v in enumerate(attention_layers)},
              **{f"attention_heads[{i}]": v for i, v in enumerate(attention_heads)})
    s = pb.SamplingOptions(temperature=temperature, top_k=top_k, min_p=min_p,
                           presence_penalty=presence_penalty,
                           frequency_penalty=frequency_penalty)
    if top_p is not None:
        s.top_p = top_p
    if repetition_penalty is not None:
        s.repetition_penalty = repetition_penalty
    if seed is not None:
        s.seed = seed
    r = pb.GenerateRequest(
        sampling=s,
        stopping=pb.StoppingOptions(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                    stop=list(stop), stop_token_ids=list(stop_token_ids),
                                    ignore_eos=ignore_eos),
        response=pb.ResponseOptions(logprobs=logprobs or top_logprobs > 0,
                                    top_logprobs=top_logprobs, return_logits=return_logits,
                                    attention=pb.AttentionOptions(layers=list(attention_layers),
                                                                  heads=list(attention_heads)),
                                    coalesce=coalesce),
        request_id=request_id)
    _structured(r.structured, json_schema, json_object, regex, choice, grammar)
    if isinstance(prediction, str):
        r.prediction.text = prediction
    elif prediction is not None:
        r.prediction.token_ids.ids.extend(int(i) for i in prediction)
    if isinstance(prompt, str):
        r.text = prompt
    elif prompt and isinstance(prompt[0], dict):  # chat messages: [{"role", "content"}, ...]
        r.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"])
                               for m in prompt)
    else:
        r.token_ids.ids.extend(int(i) for i in prompt)
    return r


def _structured(m: pb.Structured, json_schema, json_object: bool, regex, choice,
                grammar) -> None:
    given = [k for k, v in (("json_schema", json_schema), ("json_object", json_object or None),
                            ("regex", regex), ("choice", choice), ("grammar", grammar))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"one constraint at most, got {', '.join(given)}")
    if json_schema is not None:
        m.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif json_object:
        m.json_object = True
    elif regex is not None:
        m.regex = regex
    elif choice is not None:
        m.choice.choices.extend(choice)
    elif grammar is not None:
        m.grammar = grammar


def score_request(texts: Sequence[str] | None = None,
                  token_ids: Sequence[Sequence[int]] | None = None, top_logprobs: int = 0,
                  request_id: str = "") -> pb.ScoreRequest:
    if (texts is None) == (token_ids is None):
        raise ValueError("give texts or token_ids (exactly one)")
    r = pb.ScoreRequest(top_logprobs=top_logprobs, request_id=request_id)
    if texts is not None:
        r.texts.extend(texts)
    else:
        r.token_ids.extend(pb.TokenIds(ids=list(map(int, s))) for s in token_ids)
    return r


def as_generate_request(prompt: str | Sequence[int] | Sequence[dict] | pb.GenerateRequest,
                        options: dict[str, Any]) -> pb.GenerateRequest:
    """``prompt`` itself when it is a built request, else :func:`generate_request`'s."""
    if isinstance(prompt, pb.GenerateRequest):
        return prompt
    return generate_request(prompt, **options)


def tokenize_request(texts: Sequence[str]) -> pb.TokenizeRequest:
    return pb.TokenizeRequest(texts=list(texts))


def detokenize_request(token_ids: Sequence[Sequence[int]]) -> pb.DetokenizeRequest:
    return pb.DetokenizeRequest(token_ids=[pb.TokenIds(ids=list(s)) for s in token_ids])


def corpus_perplexity(total_logprob: float, scored_tokens: int) -> float:
    """exp(total NLL / scored tokens); nan when nothing was scored."""
    return math.exp(-total_logprob / scored_tokens) if scored_tokens else float("nan")

"""Python clients of ``kvserve.v1.Inference``: :class:`Client` (blocking) and :class:`AsyncClient`
(asyncio), with typed results, per-call timeouts, bearer-token auth, TLS and retries.

Retries: only ``UNAVAILABLE`` (not ready, draining, unreachable) and ``RESOURCE_EXHAUSTED``
(over capacity) are retried, with exponential backoff and full jitter. Everything else
(``INVALID_ARGUMENT``, ``UNAUTHENTICATED``, ``DEADLINE_EXCEEDED``, ...) is raised at once as a
:class:`KvserveError`. A streaming Generate that was cut after tokens were delivered is resumed
(``resume=True``, the default; ``clients/resume.py``, docs/failover.md): the next attempt
carries the delivered tokens and the server continues exactly where the stream was cut, so
the caller sees one stream (no index repeated or skipped); it is resumed on the retry codes
and on a proxy's stream reset (INTERNAL "Stream removed"), and its attempts count from the
last token delivered. An unseeded sampled request gets a seed chosen by the client so that it
can be resumed. With ``resume=False`` a started stream's error is raised.

Timeouts apply per attempt (each attempt gets the full ``timeout``); backoff sleeps are extra.

Score semantics (the server's): a sequence of T tokens yields T-1 scored tokens; ``tokens[i]``
is ``log p(token i+1 | tokens 0..i)``. The first token has no context and is not scored, and the
server prepends no BOS. ``sum_logprob``/``mean_logprob``/``perplexity`` are over the T-1 scored
tokens (a 1-token sequence: sum 0, mean 0, perplexity 1).
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator, Sequence, Union

import grpc

from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc

from .resume import ResumeError, StreamResume

log = logging.getLogger(__name__)

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: "unspecified",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS_TOKEN: "eos_token",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
    pb.FINISH_REASON_STOP_TOKEN: "stop_token",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_TIME_LIMIT: "time_limit",
    pb.FINISH_REASON_ERROR: "error",
}


# --- errors ---------------------------------------------------------------------------------------
class KvserveError(Exception):
    """A call failed. ``code`` is the gRPC status code, ``details`` the server's message,
    ``attempts`` how many attempts were made."""

    def __init__(self, code: grpc.StatusCode, details: str, attempts: int = 1):
        self.code, self.details, self.attempts = code, details or "", attempts
        super().__init__(f"{code.name}: {self.details}")

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE

    def one_line(self) -> str:
        """``CODE: message`` on a single line (for CLIs)."""
        return f"{self.code.name}: {' '.join(self.details.split())}"


def _wrap(e: grpc.RpcError, attempts: int) -> KvserveError:
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return KvserveError(code or grpc.StatusCode.UNKNOWN, details or "", attempts)


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


def _tops(xs) -> list[TopLogprob]:
    return [TopLogprob(t.id, t.logprob, t.text) for t in xs]


def _token_event(c: pb.TokenChunk, logprobs: bool) -> TokenEvent:
    return TokenEvent(
        index=c.index, id=c.id, text=c.text, logprob=c.logprob if logprobs else None,
        top_logprobs=_tops(c.top_logprobs), logits=list(c.logits) if len(c.logits) else None,
        attention=[AttentionRow(a.layer, a.head, list(a.weights)) for a in c.attention],
        special=c.special)


def _completion(c: pb.Complete) -> Completion:
    reason = FINISH_REASONS.get(c.finish_reason, str(c.finish_reason))
    return Completion(
        text=c.text, finish_reason=reason, stop_sequence=c.stop_sequence,
        stop_token_id=c.stop_token_id if reason == "stop_token" else None,
        prompt_tokens=c.prompt_tokens, generated_tokens=c.generated_tokens,
        timings=Timings(c.timings.queue_seconds, c.timings.time_to_first_token_seconds,
                        c.timings.total_seconds),
        request_id=c.request_id, error=c.error)


def _score_results(resp: pb.ScoreResponse) -> list[ScoreResult]:
    return [ScoreResult(s.token_count,
                        [ScoredToken(t.id, t.logprob, _tops(t.top_logprobs)) for t in s.tokens],
                        s.sum_logprob, s.mean_logprob, s.perplexity) for s in resp.sequences]


def _model_info(r: pb.ModelInfoResponse) -> ModelInfo:
    limits = {f.name: getattr(r.limits, f.name) for f in r.limits.DESCRIPTOR.fields}
    return ModelInfo(r.vocab_size, r.n_layers, r.n_heads, r.n_kv_heads, r.max_seq_len,
                     None if r.eos_token_id < 0 else r.eos_token_id, r.provider,
                     r.attention_available, r.version, r.manifest_sha256, r.config_json, limits)


# --- requests -------------------------------------------------------------------------------------
def generate_request(prompt: str | Sequence[int] | Sequence[dict], *, temperature: float = 0.0, top_k: int = 0,
                     top_p: float | None = None, min_p: float = 0.0,
                     repetition_penalty: float | None = None, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, seed: int | None = None,
                     max_new_tokens: int = 0, min_new_tokens: int = 0,
                     stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                     ignore_eos: bool = False, logprobs: bool = False, top_logprobs: int = 0,
                     return_logits: bool = False, attention_layers: Sequence[int] = (),
                     attention_heads: Sequence[int] = (), request_id: str = "",
                     coalesce: bool = True) -> pb.GenerateRequest:
    """Build a ``GenerateRequest``. ``prompt``: text, token ids, or chat messages (dicts with
    ``role`` and ``content``, rendered by the server with the model's chat template). ``None``
    leaves an optional field unset (the server's default); ``max_new_tokens=0`` is the server
    default. ``coalesce``: tokens ready together may share one message (the client unpacks
    them; an older server ignores it)."""
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
    if isinstance(prompt, str):
        r.text = prompt
    elif prompt and isinstance(prompt[0], dict):  # chat messages: [{"role", "content"}, ...]
        r.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"])
                               for m in prompt)
    else:
        r.token_ids.ids.extend(int(i) for i in prompt)
    return r


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


# --- retry policy ---------------------------------------------------------------------------------
@dataclass
class RetryPolicy:
    """Exponential backoff with full jitter: before retry k (1-based) sleep
    ``uniform(0, min(max_backoff, initial_backoff * multiplier**(k-1)))``."""
    max_attempts: int = 4  # 1 = no retries
    initial_backoff: float = 0.2
    max_backoff: float = 5.0
    multiplier: float = 2.0
    retry_codes: frozenset = RETRYABLE
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        bad = set(self.retry_codes) - RETRYABLE
        if bad:  # retrying e.g. INVALID_ARGUMENT would only repeat the same refusal
            raise ValueError(f"only UNAVAILABLE / RESOURCE_EXHAUSTED may be retried, not {bad}")

    def should_retry(self, code: grpc.StatusCode, attempt: int) -> bool:
        return code in self.retry_codes and attempt < self.max_attempts

    def backoff(self, attempt: int) -> float:
        cap = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return self.rng.uniform(0, cap)


NO_RETRY = RetryPolicy(max_attempts=1)

# on_attempt(method, attempt): called before every attempt (1-based), e.g. to count retries
AttemptHook = Callable[[str, int], None]


def _channel_options(extra: Sequence[tuple] = ()) -> list[tuple]:
    return [
        # reconnect soon after a server comes (back) up; gRPC's default backoff grows to 120 s
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.enable_retries", 0),  # retries are ours (and visible to the hook)
        *extra,
    ]


def _credentials(tls_ca: str | Path | None, tls: bool) -> grpc.ChannelCredentials | None:
    if tls_ca:
        return grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
    if tls:
        return grpc.ssl_channel_credentials()
    return None


class _Base:
    def __init__(self, target: str, *, token: str | None = None, tls_ca: str | Path | None = None,
                 tls: bool = False, timeout: float | None = 60.0,
                 retry: RetryPolicy | None = None, on_attempt: AttemptHook | None = None,
                 server_name: str | None = None, options: Sequence[tuple] = (),
                 resume: bool = True):
        self.target = target
        self.resume = resume  # resume started Generate streams (clients/resume.py)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.on_attempt = on_attempt
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._creds = _credentials(tls_ca, tls)
        extra = list(options)
        if server_name:
            extra.append(("grpc.ssl_target_name_override", server_name))
        self._options = _channel_options(extra)
        self._closed = False

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _stream(self, prompt, resume: bool | None, options) -> StreamResume:
        req = prompt if isinstance(prompt, pb.GenerateRequest) else \
            generate_request(prompt, **options)
        return StreamResume(req, self.resume if resume is None else resume)

    def _attempt(self, method: str, attempt: int) -> None:
        if self.on_attempt is not None:
            self.on_attempt(method, attempt)

    def _retry_or_raise(self, method: str, e: grpc.RpcError, attempt: int,
                        unary: bool = False, stream: StreamResume | None = None) -> float:
        err = _wrap(e, attempt)
        code = err.code
        if unary and code is grpc.StatusCode.CANCELLED and not self._closed:
            # this client never cancels a unary call (only closing it does): the server did,
            # as gRPC does to calls that arrive while a server stops (a restart, a drain
            # racing a retry). The calls are idempotent, so it counts as UNAVAILABLE.
            code = grpc.StatusCode.UNAVAILABLE
        if stream is not None:  # a stream that resumes: also after a proxy's stream reset
            resumes = stream.may_resume(code, err.details)
            if stream.ids and not resumes:  # a started stream: resumed, or raised
                raise err from None
            if resumes:
                code = grpc.StatusCode.UNAVAILABLE
        if not self.retry.should_retry(code, attempt):
            raise err from None
        delay = self.retry.backoff(attempt)
        log.debug("%s: %s; retry %d/%d in %.2fs", method, err.one_line(), attempt,
                 self.retry.max_attempts - 1, delay)
        return delay


# --- blocking client ------------------------------------------------------------------------------
class Client(_Base):
    """Blocking client. Thread-safe (one channel, many calls). Use as a context manager or call
    :meth:`close`."""

    def __init__(self, target: str, **kw):
        super().__init__(target, **kw)
        if self._creds is not None:
            self._channel = grpc.secure_channel(target, self._creds, options=self._options)
        else:
            self._channel = grpc.insecure_channel(target, options=self._options)
        self._stub = pb_grpc.InferenceStub(self._channel)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def _unary(self, method: str, request, timeout: float | None):
        fn = getattr(self._stub, method)
        attempt = 0
        while True:
            attempt += 1
            self._attempt(method, attempt)
            try:
                return fn(request, timeout=self._timeout(timeout), metadata=self._metadata)
            except grpc.RpcError as e:
                time.sleep(self._retry_or_raise(method, e, attempt, unary=True))

    # Generate ------------------------------------------------------------------------------------
    def generate_stream(self, prompt: str | Sequence[int] | pb.GenerateRequest, *,
                        timeout: float | None = None, on_call=None, resume: bool | None = None,
                        **options) -> Iterator[GenerateEvent]:
        """Yield a :class:`TokenEvent` per generated token, then one :class:`Completion`.
        ``options`` are the keyword arguments of :func:`generate_request`. Retried on
        UNAVAILABLE / RESOURCE_EXHAUSTED; once tokens were delivered, resumed where it was cut
        (``resume``: this call's choice, by default the client's). ``on_call(call)`` gets each
        attempt's gRPC call, so that another thread (or a signal handler's caller) can
        ``cancel()`` it while this one waits for tokens."""
        rs = self._stream(prompt, resume, options)
        lp = rs.base.response.logprobs
        attempt = 0
        while True:
            attempt += 1
            self._attempt("Generate", attempt)
            call = self._stub.Generate(rs.request(), timeout=self._timeout(timeout),
                                       metadata=self._metadata)
            if on_call is not None:
                on_call(call)
            try:
                for msg in call:
                    if not msg.HasField("chunk"):
                        yield _completion(msg.complete)
                        return
                    for c in (msg.chunk, *msg.more):
                        if rs.accept(c):
                            attempt = 1  # progress: the retry budget starts again
                            yield _token_event(c, lp)
                return
            except grpc.RpcError as e:
                delay = self._retry_or_raise("Generate", e, attempt, stream=rs)
            except ResumeError as e:
                raise KvserveError(grpc.StatusCode.DATA_LOSS, str(e), attempt) from None
            finally:
                call.cancel()  # no-op when finished; frees the server slot if we stop early
            time.sleep(delay)

    def generate(self, prompt: str | Sequence[int] | pb.GenerateRequest, *,
                 timeout: float | None = None, **options) -> Completion:
        """The whole completion, with its tokens in ``Completion.tokens``."""
        tokens: list[TokenEvent] = []
        for ev in self.generate_stream(prompt, timeout=timeout, **options):
            if isinstance(ev, TokenEvent):
                tokens.append(ev)
            else:
                return _with_tokens(ev, tokens)
        raise KvserveError(grpc.StatusCode.INTERNAL, "the stream ended without a Complete event")

    # Score / tokenizer / info --------------------------------------------------------------------
    def score(self, texts: Sequence[str] | None = None, *,
              token_ids: Sequence[Sequence[int]] | None = None, top_logprobs: int = 0,
              request_id: str = "", timeout: float | None = None) -> list[ScoreResult]:
        req = score_request(texts, token_ids, top_logprobs, request_id)
        return _score_results(self._unary("Score", req, timeout))

    def tokenize(self, texts: Sequence[str], timeout: float | None = None) -> list[list[int]]:
        r = self._unary("Tokenize", pb.TokenizeRequest(texts=list(texts)), timeout)
        return [list(t.ids) for t in r.tokens]

    def detokenize(self, token_ids: Sequence[Sequence[int]], timeout: float | None = None
                   ) -> list[str]:
        r = self._unary("Detokenize", pb.DetokenizeRequest(
            token_ids=[pb.TokenIds(ids=list(s)) for s in token_ids]), timeout)
        return list(r.texts)

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return _model_info(self._unary("ModelInfo", pb.ModelInfoRequest(), timeout))


def _with_tokens(c: Completion, tokens: list[TokenEvent]) -> Completion:
    return Completion(**{**c.__dict__, "tokens": tokens})


# --- asyncio client -------------------------------------------------------------------------------
class AsyncClient(_Base):
    """asyncio client (``grpc.aio``). Create and use it inside a running event loop;
    ``async with AsyncClient(...) as c`` closes the channel."""

    def __init__(self, target: str, **kw):
        super().__init__(target, **kw)
        if self._creds is not None:
            self._channel = grpc.aio.secure_channel(target, self._creds, options=self._options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=self._options)
        self._stub = pb_grpc.InferenceStub(self._channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        await self._channel.close()

    async def _unary(self, method: str, request, timeout: float | None):
        fn = getattr(self._stub, method)
        attempt = 0
        while True:
            attempt += 1
            self._attempt(method, attempt)
            try:
                return await fn(request, timeout=self._timeout(timeout), metadata=self._metadata)
            except grpc.RpcError as e:
                await asyncio.sleep(self._retry_or_raise(method, e, attempt, unary=True))

    async def generate_stream(self, prompt: str | Sequence[int] | pb.GenerateRequest, *,
                              timeout: float | None = None, resume: bool | None = None,
                              **options) -> AsyncIterator[GenerateEvent]:
        """As :meth:`Client.generate_stream`."""
        rs = self._stream(prompt, resume, options)
        lp = rs.base.response.logprobs
        attempt = 0
        while True:
            attempt += 1
            self._attempt("Generate", attempt)
            call = self._stub.Generate(rs.request(), timeout=self._timeout(timeout),
                                       metadata=self._metadata)
            try:
                async for msg in call:
                    if not msg.HasField("chunk"):
                        yield _completion(msg.complete)
                        return
                    for c in (msg.chunk, *msg.more):
                        if rs.accept(c):
                            attempt = 1  # progress: the retry budget starts again
                            yield _token_event(c, lp)
                return
            except grpc.RpcError as e:
                delay = self._retry_or_raise("Generate", e, attempt, stream=rs)
            except ResumeError as e:
                raise KvserveError(grpc.StatusCode.DATA_LOSS, str(e), attempt) from None
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def generate(self, prompt: str | Sequence[int] | pb.GenerateRequest, *,
                       timeout: float | None = None, **options) -> Completion:
        tokens: list[TokenEvent] = []
        async for ev in self.generate_stream(prompt, timeout=timeout, **options):
            if isinstance(ev, TokenEvent):
                tokens.append(ev)
            else:
                return _with_tokens(ev, tokens)
        raise KvserveError(grpc.StatusCode.INTERNAL, "the stream ended without a Complete event")

    async def score(self, texts: Sequence[str] | None = None, *,
                    token_ids: Sequence[Sequence[int]] | None = None, top_logprobs: int = 0,
                    request_id: str = "", timeout: float | None = None) -> list[ScoreResult]:
        req = score_request(texts, token_ids, top_logprobs, request_id)
        return _score_results(await self._unary("Score", req, timeout))

    async def tokenize(self, texts: Sequence[str], timeout: float | None = None
                       ) -> list[list[int]]:
        r = await self._unary("Tokenize", pb.TokenizeRequest(texts=list(texts)), timeout)
        return [list(t.ids) for t in r.tokens]

    async def detokenize(self, token_ids: Sequence[Sequence[int]],
                         timeout: float | None = None) -> list[str]:
        r = await self._unary("Detokenize", pb.DetokenizeRequest(
            token_ids=[pb.TokenIds(ids=list(s)) for s in token_ids]), timeout)
        return list(r.texts)

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        return _model_info(await self._unary("ModelInfo", pb.ModelInfoRequest(), timeout))


def corpus_perplexity(total_logprob: float, scored_tokens: int) -> float:
    """exp(total NLL / scored tokens); nan when nothing was scored."""
    return math.exp(-total_logprob / scored_tokens) if scored_tokens else float("nan")

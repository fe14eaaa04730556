"""Python clients of ``kvserve.v1.Inference``: :class:`Client` (blocking) and :class:`AsyncClient`
(asyncio), with typed results, per-call timeouts, bearer-token auth, TLS and retries.

Retries: only ``UNAVAILABLE`` (not ready, draining, unreachable) and ``RESOURCE_EXHAUSTED``
(over capacity) are retried, with exponential backoff and full jitter. Everything else
(``INVALID_ARGUMENT``, ``UNAUTHENTICATED``, ``DEADLINE_EXCEEDED``, ...) is raised at once as a
:class:`KvserveError`. A streaming Generate that was cut after tokens were delivered is resumed
(``resume=True``, the default; ``resume.py``, docs/failover.md): the next attempt carries the
delivered tokens and the server continues exactly where the stream was cut, so the caller sees
one stream (no index repeated or skipped); it is resumed on the retry codes and on a proxy's
stream reset (INTERNAL "Stream removed"), and its attempts count from the last token
delivered. An unseeded sampled request gets a seed chosen by the client so that it can be
resumed. With ``resume=False`` a started stream's error is raised.

Timeouts apply per attempt (each attempt gets the full ``timeout``); backoff sleeps are extra.

Both classes build their requests and parse the replies with the same pure functions
(``messages.py``, which also holds the result types and the Score semantics); each keeps only
its transport.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator, Sequence

import grpc
import grpc.experimental

from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc

from . import messages as M
from .resume import ResumeError, StreamResume
# the result types and request builders, importable from here as before
from .messages import (FINISH_REASONS, AttentionRow, Completion, GenerateEvent, ModelInfo,
                       ScoredToken, ScoreResult, Timings, TokenEvent, TopLogprob,
                       corpus_perplexity, generate_request, score_request)

__all__ = ["AsyncClient", "AttemptHook", "AttentionRow", "Client", "Completion",
           "FINISH_REASONS", "GenerateEvent", "KvserveError", "ModelInfo", "NO_RETRY",
           "RETRYABLE", "RetryPolicy", "ScoredToken", "ScoreResult", "Timings", "TokenEvent",
           "TopLogprob", "corpus_perplexity", "generate_request", "score_request"]

log = logging.getLogger(__name__)

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})

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


# a stream's call runs on the thread that reads it (gRPC's experimental option): without it,
# gRPC's blocking channel starts a thread for its calls whenever none is in flight, which
# took ~2 ms of every call made one after another (a 128-token stream of the 6M bench model
# takes ~40 ms)
_SINGLE_THREADED_STREAMS = (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)


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
        self.resume = resume  # resume started Generate streams (resume.py)
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
        return StreamResume(M.as_generate_request(prompt, options),
                            self.resume if resume is None else resume)

    def _attempt(self, method: str, attempt: int) -> None:
        if self.on_attempt is not None:
            self.on_attempt(method, attempt)

    def _retry_or_raise(self, method: str, e: grpc.RpcError, attempt: int,
                        unary: bool = False, stream: StreamResume | None = None) -> float:
        err = _wrap(e, attempt)
        code = err.code
        if code is grpc.StatusCode.CANCELLED and not self._closed and \
                (unary or (stream is not None and stream.enabled)):
            # this client cancels a call only when it is closed: the server did, as gRPC does
            # to calls that arrive while a server stops (a restart; a drain's last moment,
            # which a resumed stream can reach through a balancer). The unary calls are
            # idempotent and a resumed stream continues with the same tokens, so it counts as
            # UNAVAILABLE (a stream the caller stops ends its iteration: no error here)
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
        options = [*self._options, _SINGLE_THREADED_STREAMS]
        if self._creds is not None:
            self._channel = grpc.secure_channel(target, self._creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
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
        ``cancel()`` it while this one waits for tokens: the stream then raises CANCELLED."""
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
                    events, progress = rs.events(msg, lp)
                    attempt = 1 if progress else attempt
                    yield from events
                return
            except grpc.RpcError as e:
                if call.cancelled():  # the caller stopped it (``on_call``): neither retried
                    # nor resumed, which would generate the answer again, unseen
                    raise _wrap(e, attempt) from None
                delay = self._retry_or_raise("Generate", e, attempt, stream=rs)
            except ResumeError as e:
                raise KvserveError(grpc.StatusCode.DATA_LOSS, str(e), attempt) from None
            finally:
                call.cancel()  # no-op when finished; frees the server slot if we stop early
            time.sleep(delay)

    def generate(self, prompt: str | Sequence[int] | pb.GenerateRequest, *,
                 timeout: float | None = None, **options) -> Completion:
        """The whole completion, with its tokens in ``Completion.tokens``."""
        collect = M.Collector()
        for ev in self.generate_stream(prompt, timeout=timeout, **options):
            if (done := collect.add(ev)) is not None:
                return done
        raise KvserveError(grpc.StatusCode.INTERNAL, M.Collector.INCOMPLETE)

    # Score / tokenizer / info --------------------------------------------------------------------
    def score(self, texts: Sequence[str] | None = None, *,
              token_ids: Sequence[Sequence[int]] | None = None, top_logprobs: int = 0,
              request_id: str = "", timeout: float | None = None) -> list[ScoreResult]:
        req = M.score_request(texts, token_ids, top_logprobs, request_id)
        return M.score_results(self._unary("Score", req, timeout))

    def tokenize(self, texts: Sequence[str], timeout: float | None = None) -> list[list[int]]:
        return M.tokenized(self._unary("Tokenize", M.tokenize_request(texts), timeout))

    def detokenize(self, token_ids: Sequence[Sequence[int]], timeout: float | None = None
                   ) -> list[str]:
        return M.detokenized(self._unary("Detokenize", M.detokenize_request(token_ids),
                                         timeout))

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return M.model_info(self._unary("ModelInfo", pb.ModelInfoRequest(), timeout))


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
                    events, progress = rs.events(msg, lp)
                    attempt = 1 if progress else attempt
                    for ev in events:
                        yield ev
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
        collect = M.Collector()
        async for ev in self.generate_stream(prompt, timeout=timeout, **options):
            if (done := collect.add(ev)) is not None:
                return done
        raise KvserveError(grpc.StatusCode.INTERNAL, M.Collector.INCOMPLETE)

    async def score(self, texts: Sequence[str] | None = None, *,
                    token_ids: Sequence[Sequence[int]] | None = None, top_logprobs: int = 0,
                    request_id: str = "", timeout: float | None = None) -> list[ScoreResult]:
        req = M.score_request(texts, token_ids, top_logprobs, request_id)
        return M.score_results(await self._unary("Score", req, timeout))

    async def tokenize(self, texts: Sequence[str], timeout: float | None = None
                       ) -> list[list[int]]:
        return M.tokenized(await self._unary("Tokenize", M.tokenize_request(texts), timeout))

    async def detokenize(self, token_ids: Sequence[Sequence[int]],
                         timeout: float | None = None) -> list[str]:
        return M.detokenized(await self._unary("Detokenize", M.detokenize_request(token_ids),
                                               timeout))

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        return M.model_info(await self._unary("ModelInfo", pb.ModelInfoRequest(), timeout))

"""The OpenAI-compatible HTTP API (aiohttp), in the gRPC server's process, over the same engine,
limits, bearer token, serving state and metrics: a thin adapter like the gRPC servicer.

    POST /v1/completions        POST /v1/chat/completions   (``stream: true``: server-sent events)
    GET  /v1/models             GET  /v1/models/{model}      GET /health (200 once warmed up)

Runs its own asyncio loop on one thread. Engine events reach the loop through an asyncio queue
(``_Sink``), so a stream holds no thread. A client that disconnects cancels its handler
(``handler_cancellation``), which cancels the engine request like a gRPC cancel does.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
import time
import uuid
from typing import Any, Callable

from aiohttp import web

from . import http_log
from .domain import (FailedPrecondition, FinishEvent, FinishReason, ScoreRequest, ServingError,
                     Timings, TokenEvent, Unavailable)
from .guides import Guides
from .http_chat_request import parse_chat, tool_call_message
from .http_logprobs import Logprobs
from .http_sse import FINISH as _FINISH
from .http_sse import SseChoices
from .http_tokenize import add_tokenize_routes
from .auth import bearer_ok
from .openai_requests import ApiError, Parsed, check_json_body, from_serving_error, \
    parse_completion, parse_json
from .constraints import after_thought
from .reasoning import CLOSE as CLOSE_TAG, OPEN as OPEN_TAG, prompt_opens_thought, \
    split_reasoning
from .tool_calls import added_token_ids, finish_reason
from .validation import is_utf8

log = logging.getLogger(__name__)
# set on a request once its SSE response has started (aiohttp >= 3.11 types its keys)
_STREAMING = web.RequestKey("kvserve_streaming", bool) if hasattr(web, "RequestKey") \
    else "kvserve_streaming"

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}  # nginx: pass each event on at once


class _Sink:
    """The engine thread's events -> an asyncio queue of (choice index, event). As
    ``server.events.EventChannel``: ``stage`` holds an event back, ``wake`` hands over what is
    held in one call into the loop (the engine wakes a caller at most once per stream
    interval), ``put`` is both."""

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue, index: int):
        self.loop, self.q, self.index = loop, q, index
        self.held: list = []

    def stage(self, ev) -> None:
        self.held.append((self.index, ev))

    def wake(self) -> None:
        held, self.held = self.held, []
        if held:
            try:
                self.loop.call_soon_threadsafe(self._deliver, held)
            except RuntimeError:  # the loop is closed (server stopped): nobody is listening
                pass

    def _deliver(self, held: list) -> None:
        for item in held:
            self.q.put_nowait(item)

    def put(self, ev) -> None:
        self.stage(ev)
        self.wake()


def _json(data: Any, status: int = 200) -> web.Response:
    text = json.dumps(data, ensure_ascii=False)
    if not is_utf8(text):
        text = json.dumps(data)  # a lone surrogate echoed from the request: as a \u escape
    return web.Response(text=text, status=status, content_type="application/json")


def _error(e: ApiError) -> web.Response:
    return _json(e.body(), e.status)


class OpenAIApi:
    def __init__(self, engine, prompts, token_bytes, state, metrics, model_name: str,
                 created: int, auth_token: str = "", guides: Guides | None = None,
                 tokenizer_info: dict | None = None, reasoning: bool = False):
        """``guides``: the server's constraints (the app's ``Guides``; None: structured outputs
        and forced tool calls answer 400); ``tokenizer_info``: ``http_tokenize.tokenizer_info``
        (with it and a tokenizer, vLLM's /tokenize, /detokenize and /tokenizer_info);
        ``reasoning``: chat replies' thoughts apart (``server.reasoning``)."""
        self.engine, self.prompts, self.tb = engine, prompts, token_bytes
        self.reasoning = reasoning
        self.guides, self.tokenizer_info = guides, tokenizer_info
        self.lp = Logprobs(token_bytes)
        self._added_tokens: dict[str, int] | None = None
        self.state, self.metrics = state, metrics
        self.model, self.created = model_name, created
        self._auth = auth_token.encode() if auth_token else None

    # --- app ---------------------------------------------------------------------------------
    def app(self, max_body: int) -> web.Application:
        self.max_body = max_body
        app = web.Application(client_max_size=max_body,
                              middlewares=[self._errors, self._check_auth])
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions),
                        web.get("/v1/models", self.models),
                        web.get("/v1/models/{model:.+}", self.model_get),
                        web.get("/health", self.health)])
        if self.tokenizer_info is not None and self.prompts.tok is not None:
            add_tokenize_routes(app, self.prompts, self.tokenizer_info, self.model, self._gate)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            self._count(request, e.code or e.type)
            return _error(e)
        except web.HTTPRequestEntityTooLarge:
            self._count(request, "request_too_large")
            return _error(ApiError(413, f"the request body is over the limit of "
                                        f"{self.max_body} bytes", code="request_too_large"))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error(ApiError(e.status, e.reason or "error", code=str(e.status)))
        except Exception:  # a bug: logged here, the caller told no more than that
            if request.get(_STREAMING):  # the status line is out: nothing else can be sent
                raise
            log.exception("HTTP %s %s failed", request.method, request.path)
            self._count(request, "internal_error")
            return _error(ApiError(500, "the server failed to handle the request (internal "
                                        "error)", "server_error", code="internal_error"))

    @web.middleware
    async def _check_auth(self, request: web.Request, handler):
        if self._auth is not None and request.path != "/health":
            got = request.headers.get("Authorization", "").encode()
            if not got:
                raise ApiError(401, "missing credentials: send `Authorization: Bearer <token>`",
                               code="invalid_api_key")
            if not bearer_ok(got, self._auth):
                log.warning("rejected an HTTP request to %s: wrong token", request.path)
                raise ApiError(401, "invalid credentials", code="invalid_api_key")
        return await handler(request)

    def _count(self, request: web.Request, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.inc(rpc="http " + request.path, outcome=outcome)

    def _gate(self) -> None:
        try:
            self.state.gate()
        except Unavailable as e:
            raise from_serving_error(e) from None

    # --- simple endpoints --------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.state.draining:
            return _json({"status": "draining"}, 503)
        if not self.state.ready:
            return _json({"status": "loading"}, 503)
        return _json({"status": "ok", "model": self.model})

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created,
                "owned_by": "kvserve"}

    async def models(self, request: web.Request) -> web.Response:
        self._gate()
        return _json({"object": "list", "data": [self._model_card()]})

    async def model_get(self, request: web.Request) -> web.Response:
        self._gate()
        if request.match_info["model"] != self.model:
            raise ApiError(404, f"the model '{request.match_info['model'][:100]}' does not "
                                f"exist", param="model", code="model_not_found")
        return _json(self._model_card())

    # --- generation --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _parse(self, request: web.Request, chat: bool, rid: str) -> Parsed:
        check_json_body(request.headers)
        raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge

        def work() -> Parsed:  # JSON, the template, the tokenizer, the matchers: off the loop
            body = parse_json(raw)
            try:
                if chat:
                    parsed = parse_chat(body, self.prompts, self.model, rid, self._added())
                    if self.reasoning:
                        self._think_first(parsed)
                else:
                    parsed = parse_completion(body, self.prompts, self.model, rid)
                if parsed.spec is not None:  # one matcher per choice
                    for r in parsed.requests:
                        r.constraint = self._guides().constraint(parsed.spec)
                return parsed
            except ServingError as e:
                raise from_serving_error(e) from None

        return await asyncio.get_running_loop().run_in_executor(None, work)

    def _think_first(self, parsed: Parsed) -> None:
        """``--reasoning-parser think``: whether the prompt opened a thought; a constraint
        then applies after the thought (``constraints.after_thought``) where the tokenizer
        has the tags as tokens, else from the first token (the reply is the answer)."""
        parsed.reasoning_open = prompt_opens_thought(parsed.prompt_ids[0], self.tb)
        if parsed.spec is None:
            return
        added = self._added()
        if OPEN_TAG in added and CLOSE_TAG in added:
            self._guides().constraint(parsed.spec)  # (its own checks: a first token, ...)
            parsed.spec = after_thought(parsed.spec, added[OPEN_TAG], added[CLOSE_TAG],
                                        parsed.reasoning_open)
        else:
            parsed.reasoning_open = False

    def _guides(self) -> Guides:
        if self.guides is None:
            raise FailedPrecondition("this server has no constrained decoding")
        return self.guides

    def _added(self) -> dict[str, int]:
        """The tokenizer's added tokens (the tool-call markers a constraint asks for)."""
        if self._added_tokens is None:
            tok = self.prompts.tok
            self._added_tokens = added_token_ids(tok.to_str()) if tok is not None else {}
        return self._added_tokens

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self._gate()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        with self.state.call():
            parsed = await self._parse(request, chat, rid)
            self._gate()
            loop = asyncio.get_running_loop()
            q: asyncio.Queue = asyncio.Queue()
            handles = []
            try:
                try:
                    for i, req in enumerate(parsed.requests):
                        handles.append(self.engine.submit(req, _Sink(loop, q, i)))
                except ServingError as e:
                    raise from_serving_error(e) from None
                scored = await self._score_prompts(parsed, rid)
                n = len(parsed.prompt_ids) * parsed.n
                if parsed.stream:
                    return await self._stream(request, parsed, rid, chat, q, n, scored)
                return await self._collect(parsed, rid, chat, q, n, scored)
            finally:
                for h in handles:  # no-op for finished ones; frees the slot of the others
                    h.cancel()

    async def _score_prompts(self, parsed: Parsed, rid: str) -> list:
        """Each prompt's own logprobs (echo with logprobs, prompt_logprobs) from the engine's
        Score path; [None] * prompts when not asked."""
        if not parsed.scores_prompt:
            return [None] * len(parsed.prompt_ids)
        top = max(parsed.top_logprobs if parsed.echo else 0, parsed.prompt_logprobs or 0)
        try:
            handle, fut = self.engine.submit_score(ScoreRequest(
                [list(i) for i in parsed.prompt_ids], top, request_id=rid + "-prompt"))
        except ServingError as e:
            raise from_serving_error(e) from None
        try:
            return await asyncio.wrap_future(fut)
        except ServingError as e:
            raise from_serving_error(e) from None
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - logged, answered as a 500
            log.exception("prompt scoring for %s failed", rid)
            raise ApiError(500, f"prompt scoring failed (internal error); request {rid}",
                           "server_error", code="internal_error") from None
        finally:
            handle.cancel()

    # --- responses -----------------------------------------------------------------------------
    @staticmethod
    def _finish_error(ev: FinishEvent, rid: str, started: bool) -> ApiError | None:
        """The error a choice's finish makes of the whole request, or None. ``started``: a
        choice of the request has made a token (then one that never left the queue is an
        empty choice, finish "length", as the others' limit passed too: with n or prompts
        beyond --max-batch the last ones wait behind their siblings, and a 429 would come back
        on every retry)."""
        if ev.reason is FinishReason.ERROR:
            return ApiError(500, f"generation failed (internal error); request {rid}",
                            "server_error", code="internal_error")
        if ev.reason is FinishReason.CONSTRAINT and ev.error:
            return ApiError(400, ev.error, code="constraint_stuck")
        if ev.reason is FinishReason.CANCELLED and ev.error:
            return ApiError(503, ev.error, "service_unavailable", code="service_unavailable")
        if ev.reason is FinishReason.TIME_LIMIT and ev.error and not started:  # nothing of
            # the request ran before its time limit: at capacity
            return ApiError(429, ev.error, "rate_limit_error", code="rate_limit_exceeded")
        return None

    @staticmethod
    def _usage(finishes: dict[int, FinishEvent], parsed: Parsed) -> dict:
        # each prompt's tokens count once, whatever n is
        prompt = sum(finishes[p * parsed.n].prompt_tokens
                     for p in range(len(finishes) // parsed.n))
        cached = sum(finishes[p * parsed.n].cached_tokens
                     for p in range(len(finishes) // parsed.n))
        gen = sum(f.generated_tokens for f in finishes.values())
        # a prediction's drafted tokens that verification kept / threw away, every choice's
        return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen,
                "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {
                    "accepted_prediction_tokens": sum(
                        f.accepted_prediction_tokens for f in finishes.values()),
                    "rejected_prediction_tokens": sum(
                        f.rejected_prediction_tokens for f in finishes.values())}}

    @staticmethod
    def _no_generation(parsed: Parsed, n: int, scored: list) -> dict[int, FinishEvent]:
        """max_tokens 0 (echo): every choice ends at once, by length (its prompt's cached
        tokens: those its scoring took from the prefix cache)."""
        return {i: FinishEvent(FinishReason.LENGTH, len(parsed.prompt_ids[i // parsed.n]), 0,
                               "", Timings(), cached_tokens=getattr(
                                   scored[i // parsed.n], "cached_tokens", 0))
                for i in range(n)}

    def _completion_choice(self, i: int, parsed: Parsed, f: FinishEvent,
                           evs: list[TokenEvent], scored: list) -> dict:
        p = i // parsed.n
        prompt = parsed.prompt_texts[p] if parsed.echo else ""
        lp = self.lp.completion(evs, parsed.logprobs, len(prompt), specials=parsed.echo)
        if parsed.echo and parsed.logprobs:
            head = self.lp.echo(parsed.prompt_ids[p], scored[p], parsed.top_logprobs)
            lp = {k: head[k] + lp[k] for k in head}
        choice = {"index": i, "text": prompt + f.text, "logprobs": lp,
                  "finish_reason": _FINISH[f.reason]}
        if parsed.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.lp.vllm_prompt(parsed.prompt_ids[p], scored[p],
                                                            parsed.prompt_logprobs)
        return choice

    def _chat_choice(self, i: int, parsed: Parsed, f: FinishEvent,
                     evs: list[TokenEvent]) -> dict:
        thought, text = (None, f.text) if parsed.reasoning_open is None else \
            split_reasoning(f.text, parsed.reasoning_open)
        message, calls = tool_call_message(text, parsed.tool_format)
        if parsed.reasoning_open is not None:  # (with the parser on, always there: as vLLM)
            message["reasoning_content"] = thought
            if thought is not None and message.get("content") == "":
                message["content"] = None  # (cut off while thinking)
        return {"index": i, "message": message, "logprobs": self.lp.chat(evs, parsed.logprobs),
                "finish_reason": finish_reason(_FINISH[f.reason], bool(calls))}

    async def _collect(self, parsed: Parsed, rid: str, chat: bool, q: asyncio.Queue,
                       n: int, scored: list) -> web.Response:
        tokens: dict[int, list[TokenEvent]] = {i: [] for i in range(n)}
        finishes: dict[int, FinishEvent] = {} if parsed.generate else \
            self._no_generation(parsed, n, scored)
        while len(finishes) < n:
            i, ev = await q.get()
            if isinstance(ev, TokenEvent):
                tokens[i].append(ev)
                continue
            err = self._finish_error(ev, rid, any(tokens.values()))
            if err is not None:
                raise err
            finishes[i] = ev
        if chat:
            choices = [self._chat_choice(i, parsed, finishes[i], tokens[i]) for i in range(n)]
        else:
            choices = [self._completion_choice(i, parsed, finishes[i], tokens[i], scored)
                       for i in range(n)]
        self._count_ok(chat)
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": choices,
                "usage": self._usage(finishes, parsed)}
        if chat and parsed.prompt_logprobs is not None:  # vLLM: on the response
            body["prompt_logprobs"] = self.lp.vllm_prompt(parsed.prompt_ids[0], scored[0],
                                                          parsed.prompt_logprobs)
        return _json(body)

    def _count_ok(self, chat: bool) -> None:
        if self.metrics is not None:
            self.metrics.requests.inc(rpc="http /v1/chat/completions" if chat
                                      else "http /v1/completions", outcome="ok")

    async def _stream(self, request: web.Request, parsed: Parsed, rid: str, chat: bool,
                      q: asyncio.Queue, n: int, scored: list) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        await resp.prepare(request)
        request[_STREAMING] = True
        try:
            return await self._stream_events(resp, parsed, rid, chat, q, n, scored,
                                             lambda outcome: self._count(request, outcome))
        except ConnectionResetError:  # the client went away (``_generate`` frees its slots)
            log.info("%s: the client closed the stream", rid)
            self._count(request, "cancelled")
            return resp

    async def _stream_events(self, resp: web.StreamResponse, parsed: Parsed, rid: str,
                             chat: bool, q: asyncio.Queue, n: int, scored: list,
                             count: Callable[[str], None]) -> web.StreamResponse:
        """The SSE stream; ``count(outcome)``: an error in it, counted as the middleware counts
        one raised before the status line."""
        out = SseChoices(resp, parsed, rid, self.model, chat, n, self.lp)
        await out.start(scored)
        finishes: dict[int, FinishEvent] = {} if parsed.generate else \
            self._no_generation(parsed, n, scored)
        for i, ev in finishes.items():
            await out.finish(i, ev)
        started = False
        while len(finishes) < n:
            i, ev = await q.get()
            if isinstance(ev, TokenEvent):
                started = True
                await out.token(i, ev)
                continue
            err = self._finish_error(ev, rid, started)
            if err is not None:  # the status is sent already: the error goes in the stream
                count(err.code or err.type)
                await resp.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
                return resp
            finishes[i] = ev
            await out.finish(i, ev)
        if parsed.include_usage:
            await out.send([], self._usage(finishes, parsed))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self._count_ok(chat)
        return resp


class HttpServer:
    """The aiohttp app on its own thread and event loop."""

    def __init__(self, api: OpenAIApi, host: str, port: int, max_body: int,
                 tls_cert: str = "", tls_key: str = ""):
        self.api, self.host, self.want_port, self.max_body = api, host, port, max_body
        self.tls = (tls_cert, tls_key) if tls_cert else None
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> int:
        http_log.install()  # the requests aiohttp's parser refuses: one line each
        self._thread = threading.Thread(target=self._run, name="kvserve-http", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise OSError(f"cannot serve HTTP on {self.host}:{self.want_port}: {self._error}")
        log.info("HTTP (OpenAI-compatible) listening on %s:%d (%s)", self.host, self.port,
                 "TLS" if self.tls else "plaintext")
        return self.port

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        # by the time stop() runs, the drain has ended every request: a short shutdown wait
        runner = web.AppRunner(self.api.app(self.max_body), handler_cancellation=True,
                               access_log=None, shutdown_timeout=3.0)
        try:
            loop.run_until_complete(runner.setup())
            ctx = None
            if self.tls:
                ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                ctx.load_cert_chain(self.tls[0], self.tls[1])
            site = web.TCPSite(runner, self.host, self.want_port, ssl_context=ctx,
                               reuse_port=False)
            loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._started.set()
            loop.run_until_complete(runner.cleanup())
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def stop(self, timeout: float = 5.0) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

"""Continuous batching on one dedicated thread. Knows nothing of gRPC: domain types only.

Each loop iteration:
  1. drop queued requests that were cancelled or ran out of time;
  2. admit queued requests into free slots (up to ``max_batch``): prefill them into their KV
     slots (batched when the logits stay under the cap), sample their first token;
  3. run ONE decode step (``lm.decode``) for every active slot and sample each row with
     that request's own ``SamplingParams`` (``model.sampling``'s pure functions; a seeded
     request owns ``PCG64(seed)`` and draws one ``u`` per sampled step, exactly as
     ``model.generate`` does); a streaming caller's plain greedy sequence takes a lean step
     (its token recorded; text, event and metrics made when the caller is next woken);
  4. retire finished / cancelled / expired sequences, compacting slots with
     the cache's ``move``; so a leaving sequence frees its slot within one step;
  5. advance each Score job by one model call.
No request waits for another to finish: a new request joins at the next iteration.

A long prompt is prefilled in chunks (``extend`` after the first). Their size: as many tokens
as keep a chunk's logits (T x vocab) under ``score_chunk_floats`` where the runner returns every
row's logits (portable artifacts), and at least ``prefill_chunk_tokens`` where it returns the
last row's only (fused). With attention diagnostics asked for, the rest of the prompt after
the first (logits-sized) chunk goes through the shared decode steps instead, which carry the
attention rows.
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from kvserve.artifact.longrope import LongRopeSwitch
from kvserve.model.sampling import make_rng, next_token, token_logprobs

from .detok import IncrementalDetokenizer, StopMatcher, TokenBytes
from .domain import (FinishEvent, FinishReason, GenerateRequest, QueueFull, ScoreRequest,
                     Timings, TokenEvent, Unavailable)
from .events import EventChannel
from .scoring import score_steps
from .stopping import banned_ids, check_stop

log = logging.getLogger(__name__)

NEG_INF = np.float32(-np.inf)
_NO_TOKENS = np.zeros(0, np.int64)
# what a request still queued or decoding when the engine stops is told (as UNAVAILABLE)
SHUTTING_DOWN = "the server is shutting down (drain grace expired); retry on another replica"


class NullMetrics:
    """The hooks the engine calls; ``server.metrics.Metrics`` implements them."""

    def queue_depth(self, n: int) -> None: ...
    def running(self, n: int) -> None: ...
    def admitted(self, queue_seconds: float, prompt_tokens: int) -> None: ...
    def token(self, first: bool, seconds: float) -> None: ...
    def finished(self, reason: str, generated: int) -> None: ...
    def step(self, batch: int, seconds: float) -> None: ...


class Handle:
    """The caller's side of one request: events arrive on ``events``; ``cancel()`` any time."""

    def __init__(self, engine: "Engine", request_id: str, events=None):
        self.request_id = request_id
        # an EventChannel, or anything with its put (and stage / wake, to be woken in batches)
        # for the engine thread (the HTTP API's asyncio bridge)
        self.events = EventChannel() if events is None else events
        self._engine = engine
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._engine._wake()

    def __iter__(self) -> Iterator[TokenEvent | FinishEvent]:
        """Blocking iteration until the FinishEvent (for in-process use and tests)."""
        while True:
            ev = self.events.get()
            yield ev
            if isinstance(ev, FinishEvent):
                return


@dataclass
class _Seq:
    req: GenerateRequest
    handle: Handle
    submitted: float
    admitted: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    rng: np.random.Generator | None = None
    generated: list[int] = field(default_factory=list)
    forced: collections.deque = field(default_factory=collections.deque)  # prompt tail to feed
    feed: int = 0  # the token fed in the next decode step
    text: list[str] = field(default_factory=list)
    detok: IncrementalDetokenizer | None = None
    stopper: StopMatcher | None = None
    done: bool = False
    # from which generated-token index the batch's greedy argmax picks this sequence's token
    # (greedy, no penalties, nothing banned any more); None: never (it samples or penalises)
    argmax_from: int | None = None
    staged: bool = False  # its events box can hold events back (stage / wake)
    # from which generated-token index a step only records the argmax token (``held``) and its
    # text and event are made when its caller is next woken (``_release``): a staged caller
    # with no stop strings and nothing per token but the token; None: never
    lean_from: int | None = None
    ends: frozenset = frozenset()  # the ids that end it once armed (eos unless ignored, stops)
    held: list = field(default_factory=list)  # (token, time) chosen, not yet made events

    @property
    def wants_attention(self) -> bool:
        return self.req.output.attention


@dataclass
class _ScoreJob:
    req: ScoreRequest
    handle: Handle
    future: concurrent.futures.Future
    steps: Iterator[None] | None = None  # scoring.score_steps


class Engine:
    def __init__(self, lm, token_bytes: TokenBytes, *, max_batch: int, max_queue: int,
                 score_chunk_floats: int, eos_id: int | None, request_time_limit: float = 0.0,
                 metrics=None, eos_ids: Sequence[int] = (), stream_interval: float = 0.0,
                 prefill_chunk_tokens: int = 0, stream_interval_max: float | None = None):
        self.lm, self.cfg = lm, lm.cfg
        self.token_bytes = token_bytes
        self.max_batch, self.max_queue = max_batch, max_queue
        # tokens per prefill chunk: their logits (chunk x vocab) stay under score_chunk_floats
        self.chunk_tokens = max(1, score_chunk_floats // self.cfg.vocab_size)
        # tokens per generation prefill call (prefill_tokens(), after the cache has its
        # rows): a runner that returns the last row's logits only holds no chunk x vocab
        # logits, so a large vocabulary need not make the chunks (each a pass over the
        # weights) small
        self.score_chunk_floats = score_chunk_floats
        self.prefill_chunk_tokens = prefill_chunk_tokens if lm.last_rows else 0
        self.eos_id = eos_id
        # every id that ends a sequence (Llama 3's generation config lists three)
        self.eos_ids = frozenset([*eos_ids, *([] if eos_id is None else [eos_id])])
        self.request_time_limit = request_time_limit
        # a caller is woken at most once per stream_interval seconds (0: for every token), and
        # at once for its first token and its end (server/events.py); N callers woken together
        # wait N intervals for the next round, up to stream_interval_max: each wake-up costs a
        # thread switch and a message, so their rate stays ~1 / stream_interval in all
        self.stream_interval = stream_interval
        self.stream_interval_max = stream_interval if stream_interval_max is None \
            else max(stream_interval, stream_interval_max)
        self._interval = stream_interval  # until the next round: after one of N callers
        self._staged: set = set()  # the callers' channels holding events back
        self._holding: list[_Seq] = []  # sequences with held tokens (lean steps)
        self._woken = 0.0  # when the staged callers were last woken
        self.metrics = metrics or NullMetrics()
        self.kv = lm.new_cache(max_batch)  # lm: kvserve.artifact's FusedLM or PortableLM
        self.longrope = LongRopeSwitch.of(self.cfg)  # None unless a LongRoPE model (Phi-3)
        self.active: list[_Seq] = []  # active[i] lives in KV slot i
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._jobs: list[_ScoreJob] = []
        self._cond = threading.Condition()
        self._stop = False
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self.steps = 0
        self._running = self._queued = 0  # the running and queue gauges' last values
        # tools (profilers, tracers): called as hook(run) around each loop iteration, where
        # run() is the iteration itself; set before start() or between requests
        self.iteration_hook: Callable[[Callable[[], None]], None] | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # --- submission (any thread) ---------------------------------------------------------------
    def submit(self, req: GenerateRequest, events=None) -> Handle:
        h = Handle(self, req.request_id or f"gen-{next(self._ids)}", events)
        seq = _Seq(req, h, submitted=time.monotonic())
        if self.request_time_limit:
            limit = seq.submitted + self.request_time_limit
            req.deadline = limit if req.deadline is None else min(req.deadline, limit)
        with self._cond:
            self._check_open()
            # a sequence that has finished (its caller may already hold the Complete) frees its
            # slot now, not at the end of the engine's iteration: otherwise a caller who sends
            # the next request the moment its stream ends can be told RESOURCE_EXHAUSTED
            busy = sum(not s.done for s in list(self.active))  # list(): one atomic copy
            free = max(0, self.max_batch - busy)
            if len(self._waiting) - free >= self.max_queue:
                raise QueueFull(f"the server is at capacity ({self.max_queue} requests "
                                f"queued); retry later")
            self._waiting.append(seq)
            self._queued = len(self._waiting)
            self.metrics.queue_depth(self._queued)
            self._cond.notify_all()
        return h

    def submit_many(self, reqs: list[GenerateRequest], events: list | None = None
                    ) -> list[Handle]:
        """Several requests queued in one critical section, so the engine admits them in the
        same iteration (as far as free slots allow). All or, on QueueFull, the ones before.
        ``events``: each request's events box (as ``submit``'s), by default new channels."""
        boxes = events if events is not None else [None] * len(reqs)
        with self._cond:  # reentrant: submit takes it too
            return [self.submit(r, b) for r, b in zip(reqs, boxes, strict=True)]

    def submit_score(self, req: ScoreRequest) -> tuple[Handle, concurrent.futures.Future]:
        h = Handle(self, req.request_id or f"score-{next(self._ids)}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._check_open()
            if len(self._jobs) >= self.max_queue + 1:
                raise QueueFull("too many Score calls in progress; retry later")
            self._jobs.append(_ScoreJob(req, h, fut))
            self._cond.notify_all()
        return h, fut

    def _check_open(self) -> None:
        if self._stop or not self._accepting or not self.alive:
            raise Unavailable("the server is not accepting requests (starting or draining)")

    def load(self) -> dict[str, int]:
        with self._cond:
            return {"running": len(self.active), "queued": len(self._waiting),
                    "score_jobs": len(self._jobs)}

    # --- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        log.info("engine started: max_batch=%d max_queue=%d chunk_tokens=%d (prefill up to "
                 "%d)", self.max_batch, self.max_queue, self.chunk_tokens,
                 max(self.chunk_tokens, self.prefill_chunk_tokens))
        while True:
            with self._cond:
                while not self._stop and not self.active and not self._waiting \
                        and not self._jobs:
                    self._cond.wait()
                if self._stop:
                    break
                admit = self._take_admissions()
                if self._queued != len(self._waiting):
                    self._queued = len(self._waiting)
                    self.metrics.queue_depth(self._queued)
            try:
                if self.iteration_hook is None:
                    self._iteration(admit)
                else:
                    self.iteration_hook(lambda: self._iteration(admit))
            except Exception as e:  # never leave callers hanging: fail what is in flight
                log.exception("engine iteration failed")
                for seq in self.active + admit:
                    if not seq.done:
                        self._finish(seq, FinishReason.ERROR, error="internal error")
                self.active = []
                self._running = 0
                self.metrics.running(0)
                self.kv = self.lm.new_cache(self.max_batch)
                for job in self._jobs:
                    if not job.future.done():
                        job.future.set_exception(e)
                with self._cond:
                    self._jobs = [j for j in self._jobs if not j.future.done()]
        # shutting down: whoever is still here gets a final event
        with self._cond:
            rest = list(self._waiting) + self.active
            self._waiting.clear()
            self._queued = 0
            self.metrics.queue_depth(0)
            jobs, self._jobs = self._jobs, []
        for seq in rest:
            if not seq.done:
                self._finish(seq, FinishReason.CANCELLED, error=SHUTTING_DOWN)
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(Unavailable(SHUTTING_DOWN))
        log.info("engine stopped")

    def _take_admissions(self) -> list[_Seq]:
        """Under the lock: retire dead queued requests, pop the ones that fit."""
        if not self._waiting:
            return []
        now = time.monotonic()
        keep: collections.deque[_Seq] = collections.deque()
        for seq in self._waiting:
            if seq.handle.cancelled:
                self._finish(seq, FinishReason.CANCELLED)
            elif seq.req.deadline is not None and now >= seq.req.deadline:
                self._finish(seq, FinishReason.TIME_LIMIT)
            else:
                keep.append(seq)
        self._waiting = keep
        admit = []
        while self._waiting and len(self.active) + len(admit) < self.max_batch:
            admit.append(self._waiting.popleft())
        return admit

    def _iteration(self, admit: list[_Seq]) -> None:
        if admit:
            self._wake_staged()  # before a prefill that may take a while
            self._admit(admit)
        self._retire_dead()
        if self.active:
            self._decode_step()
        self._retire_done()
        if (self._staged or self._holding) and \
                time.monotonic() - self._woken >= self._interval:
            self._wake_staged()
        if admit or self._running != len(self.active):
            self._running = len(self.active)
            self.metrics.running(self._running)
        if self._jobs:
            self._wake_staged()
            self._advance_jobs()

    # --- admission -----------------------------------------------------------------------------
    def _admit(self, seqs: list[_Seq]) -> None:
        now = time.monotonic()
        plain, attn = [], []
        for seq in seqs:
            seq.admitted = now
            self.metrics.admitted(now - seq.submitted, len(seq.req.prompt_ids))
            p = seq.req.sampling
            seq.rng = make_rng(p.seed) if not p.greedy else None
            seq.detok = IncrementalDetokenizer(self.token_bytes)
            seq.stopper = StopMatcher(seq.req.stopping.stop)
            seq.argmax_from = self._argmax_from(seq.req)
            seq.staged = bool(self.stream_interval) and hasattr(seq.handle.events, "stage")
            seq.lean_from, seq.ends = self._lean(seq)
            (attn if seq.wants_attention else plain).append(seq)
        # room for every admitted request's prompt and new tokens (the fused cache grows now,
        # once, instead of copying its buffers in the middle of decoding)
        self.kv.reserve(max(self._rows(s) for s in (*self.active, *seqs)))
        # batched prefill of the plain ones, grouped so that B x T stays under the chunk
        chunk = self.prefill_tokens()
        plain.sort(key=lambda s: min(len(s.req.prompt_ids), chunk))
        group: list[_Seq] = []
        for seq in plain:
            t = min(len(seq.req.prompt_ids), chunk)
            if group and (len(group) + 1) * t > chunk:
                self._prefill(group, attention=False)
                group = []
            group.append(seq)
        if group:
            self._prefill(group, attention=False)
        for seq in attn:
            self._prefill([seq], attention=True)

    def _prefill(self, group: list[_Seq], attention: bool) -> None:
        # diagnostics return (H, T, T) attention rows per layer: those keep the smaller chunk
        chunk = self.chunk_tokens if attention else self.prefill_tokens()
        lens = [min(len(s.req.prompt_ids), chunk) for s in group]
        lo = len(self.active)  # the group takes the next free slots, in order
        res = self.lm.prefill(self.kv, lo, [s.req.prompt_ids[:n] for s, n in zip(group, lens)],
                              attention=attention, last=True)  # (1, V) each: the last row
        for b, (seq, n) in enumerate(zip(group, lens)):
            self.active.append(seq)
            if n < len(seq.req.prompt_ids):
                if attention:  # the rest goes through decode steps, which carry attention
                    seq.forced.extend(seq.req.prompt_ids[n:])
                    seq.feed = seq.forced.popleft()
                    continue
                self._on_logits(seq, self._extend(lo + b, seq.req.prompt_ids, n), None)
                continue
            rows = None
            if attention:  # the last prompt token's attention over the prompt
                rows = [(layer, h, res.attention[b][layer, h, n - 1])
                        for layer in seq.req.output.attention_layers
                        for h in seq.req.output.attention_heads]
            self._on_logits(seq, res.logits[b][-1], rows)

    def prefill_tokens(self) -> int:
        """Tokens per generation prefill call. ``chunk_tokens`` (the logits cap) where the
        runner computes every row's logits; where it computes the last row's only, up to
        ``prefill_chunk_tokens`` as long as the call's attention scores stay under the same
        cap: onnxruntime's CPU GroupQueryAttention holds chunk x heads x cache-rows floats."""
        by_scores = self.score_chunk_floats // (self.cfg.n_heads * max(1, self.kv.capacity))
        return max(self.chunk_tokens, min(self.prefill_chunk_tokens, by_scores))

    def _extend(self, slot: int, ids: list[int], start: int) -> np.ndarray:
        """Chunked prefill: feed ids[start:] to ``slot`` in chunks of ``prefill_tokens()``
        (LongRoPE's portable runner: of ``chunk_tokens``) after the slot's rows so far.
        Returns the last row of logits (V,)."""
        if self.longrope is not None:  # a prompt past its limit: long factors from row 0
            last = self.longrope.extend(self.lm, self.kv, slot, ids, start, self.chunk_tokens)
            if last is not None:
                return last
        step = self.prefill_tokens()
        for a in range(start, len(ids), step):
            chunk = np.asarray(ids[a:a + step], np.int64)
            last = self.lm.extend(self.kv, slot, chunk, last=True)[-1]  # (1, V) -> (V,)
        return last

    # --- decoding ------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        active = self.active
        n = len(active)
        attention = any(s.wants_attention and not s.forced for s in active)
        tokens = [s.feed for s in active]  # (n,) (runners take any sequence of ints)
        if self.longrope is not None:  # a LongRoPE row crossing: recomputed first (staged
            # events handed over before that refill, which may take a while)
            self.longrope.before_decode(self.lm, self.kv, n, self._tokens_of, self.chunk_tokens,
                                        before_refill=self._wake_staged)
        t0 = time.monotonic()
        logits, attn = self.lm.decode(self.kv, n, tokens, attention=attention)
        self.steps += 1
        now = time.monotonic()
        self.metrics.step(n, now - t0)
        # the plain greedy rows (no penalties, nothing banned at this step) take one argmax
        # over the batch (V,) rows at once: the same token next_token would pick
        plain = [s.argmax_from is not None and len(s.generated) >= s.argmax_from
                 for s in active]
        argmax = logits[:n].argmax(axis=1).tolist() if any(plain) else None
        for i, seq in enumerate(active):
            if seq.forced:
                seq.feed = seq.forced.popleft()
                continue
            if plain[i] and seq.lean_from is not None:
                k = len(seq.generated)
                tok = argmax[i]
                if k >= seq.lean_from and tok not in seq.ends \
                        and k + 1 < seq.req.stopping.max_new_tokens:  # (it goes on)
                    if not seq.held:
                        self._holding.append(seq)
                    seq.held.append((tok, now))
                    seq.generated.append(tok)
                    seq.feed = tok
                    continue
            rows = None
            if attn is not None and seq.wants_attention:
                rows = [(layer, h, attn[i][layer, h])  # (T,): the sequence's tokens so far
                        for layer in seq.req.output.attention_layers
                        for h in seq.req.output.attention_heads]
            self._on_logits(seq, logits[i], rows, argmax[i] if plain[i] else None)

    def _tokens_of(self, slot: int) -> list[int]:
        """The tokens of the sequence in ``slot`` so far (prompt, then generated)."""
        seq = self.active[slot]
        return [*seq.req.prompt_ids, *seq.generated]

    def _argmax_from(self, req: GenerateRequest) -> int | None:
        """The generated-token index from which a plain argmax of the row is the token
        ``next_token`` would pick: greedy without penalties, once no id is banned any more
        (stop ids and eos are banned before ``min_new_tokens``). None: never."""
        p, st = req.sampling, req.stopping
        if not p.greedy or p.has_penalties:
            return None
        banned = st.stop_token_ids or (self.eos_ids and not st.ignore_eos)
        return st.min_new_tokens if banned else 0

    def _lean(self, seq: _Seq) -> tuple[int | None, frozenset]:
        """(``lean_from``, ``ends``) of a sequence: lean steps need the batch argmax, a staged
        caller (the first token is always handed over at once), no stop strings (their
        matching needs each token's text) and no per-token outputs."""
        req = seq.req
        st, out = req.stopping, req.output
        if seq.argmax_from is None or not seq.staged or any(st.stop) or out.logprobs \
                or out.top_logprobs or out.return_logits or out.attention:
            return None, frozenset()
        ends = frozenset(st.stop_token_ids) | (frozenset() if st.ignore_eos else self.eos_ids)
        return max(seq.argmax_from, st.min_new_tokens, 1), ends

    def _release(self, seq: _Seq) -> None:
        """Make the events of ``seq``'s held tokens (text through its detokenizer, in order)
        and stage them for its caller."""
        held, seq.held = seq.held, []
        k = len(seq.generated) - len(held)
        for j, (tok, t) in enumerate(held):  # (never the first token: that one is put at once)
            self._emit(seq, TokenEvent(index=k + j, token_id=tok, text=seq.detok.push(tok)), t)

    def _on_logits(self, seq: _Seq, raw: np.ndarray, attention, tok: int | None = None
                   ) -> None:
        """Sample the next token of ``seq`` from its logits row (V,) (``tok``: already chosen
        by the batch's greedy argmax) and emit it."""
        if seq.held:  # its earlier tokens come first, through the same detokenizer
            self._release(seq)
        req = seq.req
        k = len(seq.generated)
        if tok is None:
            x = raw
            banned = banned_ids(req.stopping, self.eos_ids, k)
            if banned:
                x = raw.copy()
                x[banned] = NEG_INF
            if req.sampling.has_penalties:  # the token arrays are built only when used
                gen = np.asarray(seq.generated, np.int64)
                ctx = np.concatenate([np.asarray(req.prompt_ids, np.int64), gen])
            else:
                gen = ctx = _NO_TOKENS
            tok = next_token(x, req.sampling, seq.rng, ctx, gen)
        seq.generated.append(tok)
        seq.feed = tok

        stop = check_stop(tok, k, req.stopping, self.eos_ids, seq.detok, seq.stopper)
        ev = self._event(k, tok, raw, attention, stop, req.output)
        self._emit(seq, ev)
        if stop.finish is not None:
            self._finish(seq, stop.finish, stop_sequence=stop.stop_sequence,
                         stop_token=tok if stop.finish is FinishReason.STOP_TOKEN else None)

    @staticmethod
    def _event(k: int, tok: int, raw: np.ndarray, attention, stop, out) -> TokenEvent:
        ev = TokenEvent(index=k, token_id=tok, text=stop.text, special=stop.special)
        if out.logprobs or out.top_logprobs:
            ev.logprob, top_ids, top_lps = token_logprobs(raw, tok, out.top_logprobs)
            if out.top_logprobs:
                ev.top_ids, ev.top_logprobs = top_ids, top_lps
        if out.return_logits:
            ev.logits = np.array(raw, np.float32, copy=True)
        if attention:
            ev.attention = attention
        return ev

    def _emit(self, seq: _Seq, ev: TokenEvent, now: float | None = None) -> None:
        """Hand ``ev`` to the caller (staged, or put at once); ``now``: when its token was
        chosen (a held token's step), by default now."""
        if now is None:
            now = time.monotonic()
        first = ev.index == 0
        self.metrics.token(first, now - (seq.submitted if first else seq.last_token))
        if first:
            seq.first_token = now
        seq.last_token = now
        seq.text.append(ev.text)
        box = seq.handle.events
        if first or not seq.staged:
            box.put(ev)  # (a sink with put alone gets every event at once)
        else:
            box.stage(ev)
            self._staged.add(box)

    def _wake_staged(self) -> None:
        for seq in self._holding:
            if seq.held:
                self._release(seq)
        self._holding.clear()
        for box in self._staged:
            box.wake()
        self._interval = min(self.stream_interval * max(1, len(self._staged)),
                             self.stream_interval_max)
        self._staged.clear()
        self._woken = time.monotonic()

    # --- leaving -------------------------------------------------------------------------------
    def _finish(self, seq: _Seq, reason: FinishReason, stop_sequence: str = "",
                stop_token: int | None = None, error: str = "") -> None:
        if seq.held:  # (cancelled, timed out or failed between two wake-ups)
            self._release(seq)
        seq.done = True
        now = time.monotonic()
        t = Timings(queue=(seq.admitted or now) - seq.submitted,
                    ttft=(seq.first_token - seq.submitted) if seq.first_token else 0.0,
                    total=now - seq.submitted)
        ev = FinishEvent(reason=reason, prompt_tokens=len(seq.req.prompt_ids),
                         generated_tokens=len(seq.generated), text="".join(seq.text),
                         timings=t, stop_sequence=stop_sequence, stop_token_id=stop_token,
                         error=error)
        self.metrics.finished(reason.value, len(seq.generated))
        log.info("request %s finished: %s, prompt %d, generated %d, queue %.3fs, ttft %.3fs, "
                 "total %.3fs", seq.handle.request_id, reason.value, ev.prompt_tokens,
                 ev.generated_tokens, t.queue, t.ttft, t.total)
        self._staged.discard(seq.handle.events)  # the put hands over what it held back
        seq.handle.events.put(ev)

    def _retire_dead(self) -> None:
        now = time.monotonic()
        dead = False
        for seq in self.active:
            if seq.done:
                dead = True
            elif seq.handle.cancelled:
                self._finish(seq, FinishReason.CANCELLED)
                dead = True
            elif seq.req.deadline is not None and now >= seq.req.deadline:
                self._finish(seq, FinishReason.TIME_LIMIT)
                dead = True
        if dead:
            self._retire_done()

    def _retire_done(self) -> None:
        gone = [i for i, s in enumerate(self.active) if s.done]
        for i in reversed(gone):  # highest first: the last slot is never one still to remove
            last = len(self.active) - 1
            if i != last:
                self.kv.move(last, i)
                self.active[i] = self.active[last]
            self.active.pop()
        if gone:  # give back the memory long sequences left (their slots are free now)
            self.kv.shrink_to_fit(len(self.active),
                                  max((self._rows(s) for s in self.active), default=0))

    def _rows(self, seq: _Seq) -> int:
        """KV rows a sequence may fill: its prompt and new tokens, within the model's context."""
        return min(len(seq.req.prompt_ids) + seq.req.stopping.max_new_tokens + 1,
                   self.lm.cfg.max_seq_len + 1)

    # --- scoring -------------------------------------------------------------------------------
    def _advance_jobs(self) -> None:
        """One model call for the oldest Score job (jobs share the thread with decoding)."""
        job = self._jobs[0]
        try:
            if job.handle.cancelled or (job.req.deadline is not None
                                        and time.monotonic() >= job.req.deadline):
                raise concurrent.futures.CancelledError()
            if job.steps is None:
                job.steps = score_steps(self.lm, job.req, self.chunk_tokens)
            next(job.steps)
        except StopIteration as done:  # the generator returns the results
            job.future.set_result(done.value)
        except concurrent.futures.CancelledError:
            job.future.cancel()
        except Exception as e:
            log.exception("score job failed")
            job.future.set_exception(e)
        if job.future.done():
            with self._cond:
                self._jobs.remove(job)

    # --- warm-up -------------------------------------------------------------------------------
    def warmup(self, make_request: Callable[[bool], GenerateRequest], timeout: float = 120.0
               ) -> None:
        """Run real requests through the loop (plain, and attention when available)."""
        # a runner whose diagnostics graph loads on first use (fused) is not made to load it
        for attention in ([False, True] if self.lm.attention_ready else [False]):
            h = self.submit(make_request(attention))
            deadline = time.monotonic() + timeout
            for ev in h:
                if time.monotonic() > deadline:
                    raise RuntimeError("warm-up timed out")
                if isinstance(ev, FinishEvent) and ev.reason is FinishReason.ERROR:
                    raise RuntimeError(f"warm-up failed: {ev.error}")

"""Continuous batching on one dedicated thread. Knows nothing of gRPC: domain types only.

Each loop iteration:
  1. drop queued requests that were cancelled or ran out of time;
  2. admit queued requests into free slots (up to ``max_batch``): prefill them (batched when
     the logits stay under the cap), copy their K/V into ``KVBuffers`` slots, sample their
     first token;
  3. run ONE decode step (``OnnxLM.decode``) for every active slot and sample each row with
     that request's own ``SamplingParams`` (``model.sampling``'s pure functions; a seeded
     request owns ``PCG64(seed)`` and draws one ``u`` per sampled step, exactly as
     ``model.generate`` does);
  4. retire finished / cancelled / expired sequences, compacting slots with
     ``KVBuffers.move``; so a leaving sequence frees its slot within one step;
  5. advance each Score job by one model call.
No request waits for another to finish: a new request joins at the next iteration.

A prompt whose prefill logits (T x vocab) would pass ``score_chunk_floats`` is prefilled up to
that many tokens and the rest in chunks of as many through the decode graph (``OnnxLM.extend``);
with attention diagnostics asked for, the rest goes through the shared decode steps instead,
which carry the attention rows.
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from kvserve.model.sampling import log_softmax, make_rng, next_token, top_n

from .detok import IncrementalDetokenizer, StopMatcher, TokenBytes
from .domain import (FinishEvent, FinishReason, GenerateRequest, QueueFull, ScoredSequence,
                     ScoreRequest, Timings, TokenEvent, Unavailable)
from .runtime import KVBuffers, OnnxLM

log = logging.getLogger(__name__)

NEG_INF = np.float32(-np.inf)
_NO_TOKENS = np.zeros(0, np.int64)
_SCORE_BLOCK = 16  # logits rows per log-softmax call in Score (16 x vocab floats stay in cache)
_SCORE_GROUP = 512  # tokens per shared Score prefill: bigger batches fall out of cache
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
        # anything with put(event) from the engine thread (the HTTP API's asyncio bridge)
        self.events = queue.SimpleQueue() if events is None else events
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

    @property
    def wants_attention(self) -> bool:
        return self.req.output.attention


@dataclass
class _ScoreJob:
    req: ScoreRequest
    handle: Handle
    future: concurrent.futures.Future
    steps: Iterator[None] | None = None


class _Scored:
    """Per-token logprobs of one Score sequence, filled chunk by chunk."""

    def __init__(self, ids: list[int], n_top: int):
        T = len(ids)
        self.ids, self.n_top = ids, n_top
        self.lps = np.zeros(T - 1, np.float32)
        self.tops_i = np.zeros((T - 1, n_top), np.int64) if n_top else None
        self.tops_l = np.zeros((T - 1, n_top), np.float32) if n_top else None

    def record(self, start: int, rows: np.ndarray) -> None:
        """rows (t, V): logits at positions start.. (row j predicts ids[start + j + 1])."""
        t = min(len(rows), len(self.ids) - 1 - start)
        if t <= 0:
            return
        for a in range(0, t, _SCORE_BLOCK):  # blocks of rows that stay in cache
            b = min(a + _SCORE_BLOCK, t)
            lp = log_softmax(rows[a:b])  # (b - a, V)
            target = np.asarray(self.ids[start + a + 1:start + b + 1], np.int64)
            self.lps[start + a:start + b] = lp[np.arange(b - a), target]
            for j in range(b - a if self.n_top else 0):
                self.tops_i[start + a + j], self.tops_l[start + a + j] = top_n(lp[j],
                                                                               self.n_top)

    def result(self) -> ScoredSequence:
        return ScoredSequence(len(self.ids), np.asarray(self.ids[1:], np.int64), self.lps,
                              self.tops_i, self.tops_l)


class Engine:
    def __init__(self, lm: OnnxLM, token_bytes: TokenBytes, *, max_batch: int, max_queue: int,
                 prefill_floats: int, eos_id: int | None, request_time_limit: float = 0.0,
                 metrics=None, extra_eos_ids: tuple[int, ...] = ()):
        self.lm, self.cfg = lm, lm.cfg
        self.token_bytes = token_bytes
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefill_tokens = max(1, prefill_floats // self.cfg.vocab_size)
        self.eos_id = eos_id
        # every id that ends a sequence (a model may have several: Llama 3's <|eot_id|>...)
        self.eos_ids = frozenset(([] if eos_id is None else [eos_id]) + list(extra_eos_ids))
        self.request_time_limit = request_time_limit
        self.metrics = metrics or NullMetrics()
        self.kv = KVBuffers(self.cfg, max_batch)
        self.active: list[_Seq] = []  # active[i] lives in KV slot i
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._jobs: list[_ScoreJob] = []
        self._cond = threading.Condition()
        self._stop = False
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self.steps = 0

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
            self.metrics.queue_depth(len(self._waiting))
            self._cond.notify_all()
        return h

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
        log.info("engine started: max_batch=%d max_queue=%d prefill_tokens=%d",
                 self.max_batch, self.max_queue, self.prefill_tokens)
        while True:
            with self._cond:
                while not self._stop and not self.active and not self._waiting \
                        and not self._jobs:
                    self._cond.wait()
                if self._stop:
                    break
                admit = self._take_admissions()
                self.metrics.queue_depth(len(self._waiting))
            try:
                self._iteration(admit)
            except Exception as e:  # never leave callers hanging: fail what is in flight
                log.exception("engine iteration failed")
                for seq in self.active + admit:
                    if not seq.done:
                        self._finish(seq, FinishReason.ERROR, error="internal error")
                self.active = []
                self.kv = KVBuffers(self.cfg, self.max_batch)
                for job in self._jobs:
                    if not job.future.done():
                        job.future.set_exception(e)
                with self._cond:
                    self._jobs = [j for j in self._jobs if not j.future.done()]
        # shutting down: whoever is still here gets a final event
        with self._cond:
            rest = list(self._waiting) + self.active
            self._waiting.clear()
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
            self._admit(admit)
        self._retire_dead()
        if self.active:
            self._decode_step()
        self._retire_done()
        self.metrics.running(len(self.active))
        if self._jobs:
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
            (attn if seq.wants_attention else plain).append(seq)
        # batched prefill of the plain ones, grouped so that B x T x V stays under the cap
        plain.sort(key=lambda s: min(len(s.req.prompt_ids), self.prefill_tokens))
        group: list[_Seq] = []
        for seq in plain:
            t = min(len(seq.req.prompt_ids), self.prefill_tokens)
            if group and (len(group) + 1) * t > self.prefill_tokens:
                self._prefill(group, attention=False)
                group = []
            group.append(seq)
        if group:
            self._prefill(group, attention=False)
        for seq in attn:
            self._prefill([seq], attention=True)

    def _prefill(self, group: list[_Seq], attention: bool) -> None:
        lens = [min(len(s.req.prompt_ids), self.prefill_tokens) for s in group]
        T = max(lens)
        pad = self.cfg.pad_token_id or 0
        ids = np.full((len(group), T), pad, np.int64)
        mask = np.zeros((len(group), T), np.int64)
        for b, (seq, n) in enumerate(zip(group, lens)):
            ids[b, T - n:] = seq.req.prompt_ids[:n]
            mask[b, T - n:] = 1
        res = self.lm.prefill(ids, mask, attention=attention)
        for b, (seq, n) in enumerate(zip(group, lens)):
            slot = len(self.active)
            self.kv.load_prompt(slot, res.present, b, n)
            self.active.append(seq)
            if n < len(seq.req.prompt_ids):
                if attention:  # the rest goes through decode steps, which carry attention
                    seq.forced.extend(seq.req.prompt_ids[n:])
                    seq.feed = seq.forced.popleft()
                    continue
                self._on_logits(seq, self._extend(slot, seq.req.prompt_ids, n), None)
                continue
            rows = None
            if attention:
                rows = [(layer, h, res.attentions[layer][b, h, T - 1, T - n:])
                        for layer in seq.req.output.attention_layers
                        for h in seq.req.output.attention_heads]
            self._on_logits(seq, res.logits[b, T - 1], rows)

    def _extend(self, slot: int, ids: list[int], start: int) -> np.ndarray:
        """Chunked prefill: feed ids[start:] to ``slot`` in chunks whose logits stay under the
        cap (through the decode graph with the slot's rows as the past). Returns the last
        row of logits (V,)."""
        for a in range(start, len(ids), self.prefill_tokens):
            chunk = np.asarray(ids[a:a + self.prefill_tokens], np.int64)
            last = self.lm.extend(self.kv, slot, chunk)[-1]  # (T, V) -> (V,)
        return last

    # --- decoding ------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        n = len(self.active)
        attention = any(s.wants_attention and not s.forced for s in self.active)
        tokens = np.array([s.feed for s in self.active], np.int64)
        used = self.kv.used[:n].copy()
        t0 = time.monotonic()
        logits, attn = self.lm.decode(self.kv, n, tokens, used, attention=attention)
        self.steps += 1
        self.metrics.step(n, time.monotonic() - t0)
        cap = self.kv.capacity
        for i, seq in enumerate(self.active):
            if seq.forced:
                seq.feed = seq.forced.popleft()
                continue
            rows = None
            if attn is not None and seq.wants_attention:
                u = int(used[i])
                rows = [(layer, h, np.concatenate([attn[layer][i, h, 0, :u],
                                                   attn[layer][i, h, 0, cap:cap + 1]]))
                        for layer in seq.req.output.attention_layers
                        for h in seq.req.output.attention_heads]
            self._on_logits(seq, logits[i], rows)

    def _on_logits(self, seq: _Seq, raw: np.ndarray, attention) -> None:
        """Sample the next token of ``seq`` from its logits row (V,) and emit it."""
        req, st = seq.req, seq.req.stopping
        k = len(seq.generated)
        x = raw
        if k < st.min_new_tokens:  # the stops cannot be chosen yet
            banned = list(st.stop_token_ids)
            if self.eos_id is not None and not st.ignore_eos:
                banned.append(self.eos_id)
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

        out = req.output
        ev = TokenEvent(index=k, token_id=tok, text="")
        if out.logprobs or out.top_logprobs:
            lp = log_softmax(raw)
            ev.logprob = float(lp[tok])
            if out.top_logprobs:
                ev.top_ids, ev.top_logprobs = top_n(lp, out.top_logprobs)
        if out.return_logits:
            ev.logits = np.array(raw, np.float32, copy=True)
        if attention:
            ev.attention = attention

        finish, stop_seq = None, ""
        armed = k >= st.min_new_tokens
        if armed and tok in self.eos_ids and not st.ignore_eos:
            finish, ev.special = FinishReason.EOS_TOKEN, True
        elif armed and tok in st.stop_token_ids:
            finish, ev.special = FinishReason.STOP_TOKEN, True
        else:
            r = seq.stopper.push(seq.detok.push(tok), armed)
            ev.text = r.text
            if r.stop is not None:
                finish, stop_seq = FinishReason.STOP_SEQUENCE, r.stop
        if finish is None and len(seq.generated) >= st.max_new_tokens:
            finish = FinishReason.LENGTH
        if finish is not None and finish is not FinishReason.STOP_SEQUENCE:
            r = seq.stopper.push(seq.detok.flush(), armed)
            ev.text += r.text
            if r.stop is not None:
                finish, stop_seq = FinishReason.STOP_SEQUENCE, r.stop
            else:
                ev.text += seq.stopper.flush()

        now = time.monotonic()
        first = k == 0
        self.metrics.token(first, now - (seq.submitted if first else seq.last_token))
        if first:
            seq.first_token = now
        seq.last_token = now
        seq.text.append(ev.text)
        seq.handle.events.put(ev)
        if finish is not None:
            self._finish(seq, finish, stop_sequence=stop_seq,
                         stop_token=tok if finish is FinishReason.STOP_TOKEN else None)

    # --- leaving -------------------------------------------------------------------------------
    def _finish(self, seq: _Seq, reason: FinishReason, stop_sequence: str = "",
                stop_token: int | None = None, error: str = "") -> None:
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
        seq.handle.events.put(ev)

    def _retire_dead(self) -> None:
        now = time.monotonic()
        for seq in self.active:
            if seq.done:
                continue
            if seq.handle.cancelled:
                self._finish(seq, FinishReason.CANCELLED)
            elif seq.req.deadline is not None and now >= seq.req.deadline:
                self._finish(seq, FinishReason.TIME_LIMIT)
        self._retire_done()

    def _retire_done(self) -> None:
        gone = [i for i, s in enumerate(self.active) if s.done]
        for i in reversed(gone):  # highest first: the last slot is never one still to remove
            last = len(self.active) - 1
            if i != last:
                self.kv.move(last, i)
                self.active[i] = self.active[last]
            self.active.pop()
        if gone:  # attention spans the whole capacity: give back what long sequences left
            self.kv.shrink_to_fit(len(self.active))

    # --- scoring -------------------------------------------------------------------------------
    def _advance_jobs(self) -> None:
        """One model call for the oldest Score job (jobs share the thread with decoding)."""
        job = self._jobs[0]
        try:
            if job.handle.cancelled or (job.req.deadline is not None
                                        and time.monotonic() >= job.req.deadline):
                raise concurrent.futures.CancelledError()
            if job.steps is None:
                job.steps = self._score_steps(job)
            next(job.steps)
        except StopIteration:
            pass
        except concurrent.futures.CancelledError:
            job.future.cancel()
        except Exception as e:
            log.exception("score job failed")
            job.future.set_exception(e)
        if job.future.done():
            with self._cond:
                self._jobs.remove(job)

    def _score_steps(self, job: _ScoreJob) -> Iterator[None]:
        """Sequences short enough share left-padded prefills whose logits (B x T x V) stay
        under the cap; a longer one prefills its first chunk, then the next chunks through the
        decode graph with a private KV buffer as their past. One model call per loop turn
        (generation steps interleave); never more than one chunk of logits held."""
        seqs, cap = job.req.sequences, self.prefill_tokens
        group_cap = min(cap, _SCORE_GROUP)
        acc = [_Scored(ids, job.req.top_logprobs) for ids in seqs]
        short = sorted((i for i, ids in enumerate(seqs) if len(ids) <= cap),
                       key=lambda i: len(seqs[i]))
        group: list[int] = []
        for i in short + [None]:
            if group and (i is None or (len(group) + 1) * len(seqs[i]) > group_cap):
                self._score_prefill([seqs[j] for j in group], [acc[j] for j in group])
                group = []
                yield
            if i is not None:
                group.append(i)
        for ids, a in zip(seqs, acc):
            T = len(ids)
            if T <= cap:
                continue
            arr = np.asarray(ids[:cap], np.int64)[None]
            res = self.lm.prefill(arr, np.ones_like(arr))
            a.record(0, res.logits[0])
            kv = KVBuffers(self.cfg, 1, capacity=T + 1)
            kv.load_prompt(0, res.present, 0, cap)
            del res
            yield
            for start in range(cap, T - 1, cap):  # one chunk per loop turn
                chunk = np.asarray(ids[start:min(start + cap, T - 1)], np.int64)
                a.record(start, self.lm.extend(kv, 0, chunk))  # (t, V)
                yield
        job.future.set_result([a.result() for a in acc])

    def _score_prefill(self, seqs: list[list[int]], acc: list["_Scored"]) -> None:
        T = max(len(ids) for ids in seqs)
        ids = np.full((len(seqs), T), self.cfg.pad_token_id or 0, np.int64)
        mask = np.zeros((len(seqs), T), np.int64)
        for b, s in enumerate(seqs):
            ids[b, T - len(s):] = s
            mask[b, T - len(s):] = 1
        logits = self.lm.prefill(ids, mask).logits  # (B, T, V)
        for b, (s, a) in enumerate(zip(seqs, acc)):
            a.record(0, logits[b, T - len(s):])

    # --- warm-up -------------------------------------------------------------------------------
    def warmup(self, make_request: Callable[[bool], GenerateRequest], timeout: float = 120.0
               ) -> None:
        """Run real requests through the loop (plain, and attention when available)."""
        for attention in ([False, True] if self.lm.has_attention else [False]):
            h = self.submit(make_request(attention))
            deadline = time.monotonic() + timeout
            for ev in h:
                if time.monotonic() > deadline:
                    raise RuntimeError("warm-up timed out")
                if isinstance(ev, FinishEvent) and ev.reason is FinishReason.ERROR:
                    raise RuntimeError(f"warm-up failed: {ev.error}")

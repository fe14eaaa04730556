"""The engine core: continuous batching on one dedicated thread. Knows nothing of gRPC:
domain types only. Its roles live beside it, as in vLLM v1: ``scheduler`` (queue, admission,
slots, prefill chunks, retirement), ``sampler`` (logits -> token), ``output`` (token -> event,
end rules through ``stopping``, callers woken in rounds); ``interfaces`` declares the runner,
KV cache and event sink it drives.

Each loop iteration:
  1. drop queued requests that were cancelled or ran out of time;
  2. admit queued requests into free slots (up to ``max_batch``): prefill them into their KV
     slots (batched when the logits stay under the cap), sample their first token;
  3. run ONE decode step (``lm.decode``) for every active slot and sample each row with
     that request's own ``SamplingParams``; a streaming caller's plain greedy sequence takes a
     lean step (its token recorded; text, event and metrics made when the caller is next
     woken: ``stopping.QuietRule``);
  4. retire finished / cancelled / expired sequences, compacting slots with the cache's
     ``move``; so a leaving sequence frees its slot within one step;
  5. advance each Score job by one model call.
With nothing to do, the engine copies the rows free slots kept into the prefix cache and makes
the pool's next blocks resident (after ``SAVE_WHEN_IDLE_AFTER`` without a new request, a piece
at a time: ``ModelRunner.idle_work``), then waits.
A resumed request (``server.resume``: it carries the tokens an earlier call delivered) is
brought to where that call left off at admission, and its prefill feeds prompt + those tokens.
No request waits for another to finish: a new request joins at the next iteration.

A long prompt is prefilled in chunks (``extend`` after the first). Their size: as many tokens
as keep a chunk's logits (T x vocab) under ``score_chunk_floats`` where the runner returns every
row's logits (portable artifacts), and ``prefill_chunk_tokens`` where it returns the last
row's only (fused; ``Scheduler.prefill_tokens``). With attention diagnostics asked for, the
rest of the prompt after the first (logits-sized) chunk goes through the shared decode steps
instead, which carry the attention rows.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable, Sequence as Seq

from kvserve.artifact.longrope import LongRopeSwitch
from kvserve.artifact.prefix_pool import make_prefix_pool
from kvserve.model.sampling import request_seed

from . import resume
from .detok import IncrementalDetokenizer, StopMatcher, TokenBytes
from .domain import FinishEvent, FinishReason, GenerateRequest, InvalidArgument, QueueFull, \
    ScoreRequest, Unavailable
from .interfaces import EngineMetrics, NullMetrics, Runner, is_staged_sink
from .model_runner import ModelRunner
from .output import OutputProcessor
from .prefix_cache import BLOCK_TOKENS, PrefixCache, prefix_cache_unsupported_reason
from .rounding import diagnostics_apart, shape_sensitive
from .scheduler import Scheduler
from .score_cache import KeepPolicy, ScorePool
from .scoring import score_steps
from .sequence import Handle, ScoreJob, Sequence
from .fast_forward import FastForward
from .speculation import Speculator
from .step_costs import StepCosts
from .stopping import argmax_from, quiet_rule

log = logging.getLogger(__name__)

# an idle engine waits this long for a next request before it copies the rows free slots kept
# into the prefix cache (``ModelRunner.unsaved``): a chat client sends its next turn the moment
# the last one ends, and that turn takes the rows over without the copy
SAVE_WHEN_IDLE_AFTER = 0.005
# what a request still queued or decoding when the engine stops is told (as UNAVAILABLE)
SHUTTING_DOWN = "the server is shutting down (drain grace expired); retry on another replica"

__all__ = ["Engine", "Handle", "NullMetrics", "SHUTTING_DOWN"]


class Engine:
    def __init__(self, lm: Runner, token_bytes: TokenBytes, *, max_batch: int, max_queue: int,
                 score_chunk_floats: int, eos_id: int | None, request_time_limit: float = 0.0,
                 metrics: EngineMetrics | None = None, eos_ids: Seq[int] = (),
                 stream_interval: float = 0.0, prefill_chunk_tokens: int = 0,
                 stream_interval_max: float | None = None, prefix_cache_bytes: int = 0,
                 speculative_tokens: int = 0, fast_forward: bool = True,
                 inexact_speedups: bool = False, interleave_prefill: bool = True):
        self.lm, self.cfg = lm, lm.cfg
        self.token_bytes = token_bytes
        self.max_batch, self.max_queue = max_batch, max_queue
        self.eos_id = eos_id
        # every id that ends a sequence (Llama 3's generation config lists three)
        self._eos_ids = frozenset([*eos_ids, *([] if eos_id is None else [eos_id])])
        self.request_time_limit = request_time_limit
        self.stream_interval = stream_interval
        self._metrics = metrics or NullMetrics()
        self.output = OutputProcessor(self._eos_ids, self._metrics, stream_interval,
                                      stream_interval_max)
        self.sched = Scheduler(
            lm.new_cache(max_batch), max_batch=max_batch, max_queue=max_queue,
            max_seq_len=self.cfg.max_seq_len, n_heads=self.cfg.n_heads,
            vocab_size=self.cfg.vocab_size, score_chunk_floats=score_chunk_floats,
            prefill_chunk_tokens=prefill_chunk_tokens if lm.last_rows else None,
            output=self.output)
        self.chunk_tokens = self.sched.chunk_tokens
        self.longrope = LongRopeSwitch.of(self.cfg)  # None unless a LongRoPE model (Phi-3)
        self.costs = StepCosts()  # the steps' measured seconds: both drafters read them
        # where a row's logits depend on the call's shape beyond 1e-4 (quantized, fp16): no
        # feature that changes the calls, unless asked (server.rounding)
        sensitive = shape_sensitive(lm)
        self.inexact = "" if inexact_speedups else sensitive
        if self.inexact and (prefix_cache_bytes or speculative_tokens or fast_forward):
            # (on the native kernel attention is alike already: what differs is a matmul)
            cure = "an export in smaller blocks (--int4-block-size 32) may run them exactly" \
                if getattr(lm, "row_invariant_attention", False) else \
                "an export with --paired-attention runs them exactly"
            log.info("%s: the prefix cache, speculative decoding and constraint fast-forward "
                     "are off (--inexact-speedups turns them on; %s)", self.inexact, cure)
        elif inexact_speedups and sensitive:
            log.info("--inexact-speedups: %s; outputs may differ from those without the "
                     "speed features", sensitive)
        self.sched.fixed_chunks = bool(self.inexact)
        # a long prompt fed a chunk per iteration between the others' steps (the fused
        # graph's prefill continues a slot's rows; LongRoPE's refill takes the prompt whole)
        self.sched.interleave = interleave_prefill and lm.kind == "fused" and \
            self.longrope is None
        self.sched.attention_alone = diagnostics_apart(lm) and not (inexact_speedups and
                                                                    sensitive)
        if getattr(lm, "device", "cpu") != "cpu":  # (scheduler.PAD_TOKENS: measured on CPU)
            self.sched.pad_tokens = None
        self.prefix, self.spec = self._speedups(prefix_cache_bytes, speculative_tokens)
        # a Score request's sequences that begin alike prefill their shared tokens once
        # (server.scoring): where rows are shared at all, and the graph feeds slots that
        # hold rows already in one call
        self.score_shares = self.prefix is not None and self.lm.kind == "fused"
        # whether Score's rows are kept for later Scores: backs off while none are taken
        self.score_keep = KeepPolicy()
        # the tokens a constraint forces, fed as that row's draft (exact; its own switch)
        self.fast_forward = FastForward(self.cfg.max_seq_len, costs=self.costs) \
            if fast_forward and getattr(lm, "supports_verify", False) and not self.inexact \
            else None
        self.runner = ModelRunner(lm, self.sched, self.output, lambda: self._metrics,
                                  self.longrope, self.prefix, self.spec, self.fast_forward,
                                  self.costs)
        self.sched.on_leave = self._left
        self._jobs: list[ScoreJob] = []
        self._cond = threading.Condition()
        self._stop = False
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self._running = self._queued = 0  # the running and queue gauges' last values
        # tools (profilers, tracers): called as hook(run) around each loop iteration, where
        # run() is the iteration itself; set before start() or between requests
        self.iteration_hook: Callable[[Callable[[], None]], None] | None = None

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self._eos_ids = self.output.eos_ids = frozenset(ids)

    @property
    def metrics(self) -> EngineMetrics:
        return self._metrics

    @metrics.setter
    def metrics(self, m: EngineMetrics) -> None:  # (the app swaps them out for its warm-up)
        self._metrics = self.output.metrics = m

    def _speedups(self, prefix_bytes: int, spec_tokens: int):
        """The prefix cache and the speculator, where this runner and model allow them (each
        off is logged with the reason)."""
        prefix = spec = None
        if self.inexact:  # (logged above)
            return prefix, spec
        if prefix_bytes:
            why = prefix_cache_unsupported_reason(self.cfg) or \
                ("" if self.lm.kind in ("fused", "portable")
                 else f"the {self.lm.kind} runner keeps no prefix pool")
            pool = None if why else make_prefix_pool(self.lm, prefix_bytes, BLOCK_TOKENS)
            if pool is None and why:
                log.info("prefix cache off: %s", why)
            elif pool is None:
                log.warning("prefix cache off: %d bytes (--prefix-cache-mb) hold no block of "
                            "%d tokens", prefix_bytes, BLOCK_TOKENS)
            else:
                prefix = PrefixCache(pool)
                log.info("prefix cache: %d blocks of %d tokens, %.1f MiB", pool.n_blocks,
                         pool.block_tokens, pool.nbytes / (1 << 20))
        if spec_tokens:
            if getattr(self.lm, "supports_verify", False):
                spec = Speculator(spec_tokens, self.cfg.max_seq_len, self.costs)
            else:
                log.info("speculative decoding off: this runner cannot verify drafts")
        return prefix, spec

    @property
    def steps(self) -> int:
        """Model steps (decode or verification) so far."""
        return self.runner.steps

    @property
    def kv(self):
        return self.sched.kv

    @property
    def active(self) -> list[Sequence]:
        return self.sched.active

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
        # prompt + new tokens within the context (the servers' request checks hold their
        # requests to it first): an in-process caller's longer request ends there (LENGTH)
        # instead of failing the batch with a call past the context
        room = self.cfg.max_seq_len - len(req.prompt_ids)
        if room < 1:
            raise InvalidArgument(f"the prompt has {len(req.prompt_ids)} tokens; the model's "
                                  f"context is {self.cfg.max_seq_len}", field="prompt")
        if req.stopping.max_new_tokens > room:
            req.stopping = dataclasses.replace(req.stopping, max_new_tokens=room)
        h = Handle(req.request_id or f"gen-{next(self._ids)}", self._wake, events)
        seq = Sequence(req, h, submitted=time.monotonic())
        if self.request_time_limit:
            limit = seq.submitted + self.request_time_limit
            req.deadline = limit if req.deadline is None else min(req.deadline, limit)
        with self._cond:
            self._check_open()
            self.sched.enqueue(seq)
            self._queued = len(self.sched.waiting)
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
        h = Handle(req.request_id or f"score-{next(self._ids)}", self._wake)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._check_open()
            if len(self._jobs) >= self.max_queue + 1:
                raise QueueFull("too many Score calls in progress; retry later")
            self._jobs.append(ScoreJob(req, h, fut))
            self._cond.notify_all()
        return h, fut

    def _check_open(self) -> None:
        if self._stop or not self._accepting or not self.alive:
            raise Unavailable("the server is not accepting requests (starting or draining)")

    def load(self) -> dict[str, int]:
        with self._cond:
            return {"running": len(self.sched.active) + len(self._fed()),
                    "queued": len(self.sched.waiting),
                    "score_jobs": len(self._jobs)}

    # --- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        log.info("engine started: max_batch=%d max_queue=%d; a model call feeds up to %d "
                 "prompt tokens, %d where every row's logits or attention come back (Score, "
                 "diagnostics: --score-chunk-floats over the vocabulary)", self.max_batch,
                 self.max_queue, self.sched.prefill_tokens(), self.chunk_tokens)
        try:
            self._loop()
        except Exception:  # (a failure its recovery could not survive: no KV cache)
            log.exception("the engine stopped")
            self._shut_down()

    def _loop(self) -> None:
        sched = self.sched
        settled = False  # idle for SAVE_WHEN_IDLE_AFTER already: idle work goes on piecewise
        while True:
            idle = False
            with self._cond:
                if self._idle() and self.runner.idle_work:  # a next request first (a chat's
                    # next turn takes its slot's rows over: nothing to copy before it)
                    if not settled:
                        self._cond.wait(SAVE_WHEN_IDLE_AFTER)
                    idle = self._idle()
                while not idle and self._idle():
                    self._cond.wait()
                if self._stop:
                    break
                admit = [] if idle else sched.take_admissions()
                if self._queued != len(sched.waiting):
                    self._queued = len(sched.waiting)
                    self.metrics.queue_depth(self._queued)
            settled = idle
            if idle:  # nothing else to do: the rows free slots kept go into the prefix cache,
                # then the pool's next blocks are made resident, a piece at a time
                self._guarded(self.runner.idle_step, [])
            else:
                self._guarded(lambda: self._iteration(admit), admit)
        self._shut_down()

    def _fed(self) -> list[Sequence]:
        """The sequence whose prompt is being fed a chunk per iteration, if any (read once:
        ``load`` runs in other threads while the engine's may end the feeding)."""
        fed = self.sched.prefilling
        return [] if fed is None else [fed.seq]

    def _idle(self) -> bool:
        """Nothing to do (under the lock): no request active or queued, no Score job."""
        return not self._stop and not self.sched.active and not self.sched.waiting \
            and not self._jobs and self.sched.prefilling is None

    def _guarded(self, work: Callable[[], None], admit: list[Sequence]) -> None:
        """One iteration's ``work`` (through ``iteration_hook`` when set); an exception fails
        what is in flight (``admit``: the requests it was admitting) instead of the thread."""
        try:
            if self.iteration_hook is None:
                work()
            else:
                self.iteration_hook(work)
        except Exception as e:  # never leave callers hanging: fail what is in flight
            log.exception("engine iteration failed")
            self._fail_all(admit, e)

    def _fail_all(self, admit: list[Sequence], e: Exception) -> None:
        """After a failed iteration: the requests in flight start again from the tokens
        their callers have had (``resume.restart``: their streams go on unchanged), once;
        those that cannot fail (ERROR; CANCELLED where their callers left); so do the Score
        calls in flight. If the engine cannot get a new KV cache, the restarted ones fail too
        (and the exception ends the engine's thread)."""
        again = []
        for seq in self.sched.active + admit + self._fed():
            if seq.done:
                continue
            try:
                new = resume.restart(seq, self.output)
            except Exception:  # (never leave the failure path half done)
                log.exception("request %s could not be restarted", seq.handle.request_id)
                new = None
            if new is not None:
                seq.done = True  # (the new sequence carries its request on)
                again.append(new)
            elif seq.handle.cancelled:
                self.output.finish(seq, FinishReason.CANCELLED)
            else:
                self.output.finish(seq, FinishReason.ERROR, error="internal error")
        self.sched.active = []
        self.sched.prefilling = None
        self._running = 0
        try:
            self.runner.drop_unsaved()  # (rows of the cache being dropped)
            self.sched.kv = None  # (the old cache freed before the new one is made)
            self.sched.kv = self.lm.new_cache(self.max_batch)
        except Exception:
            for seq in again:
                self.output.finish(seq, FinishReason.ERROR, error="internal error")
            raise
        with self._cond:
            self.sched.waiting.extendleft(reversed(again))  # first in line
        if again:
            log.warning("re-admitting %d request(s) from the tokens they delivered",
                        len(again))
        for job in self._jobs:
            if not job.future.done():
                job.future.set_exception(e)
        with self._cond:
            self._jobs = [j for j in self._jobs if not j.future.done()]
        self.metrics.running(0)
        self.metrics.iteration_failed(len(again))

    def _shut_down(self) -> None:
        """Whoever is still here gets a final event."""
        with self._cond:
            rest = list(self.sched.waiting) + self.sched.active + self._fed()
            self.sched.prefilling = None
            self.sched.waiting.clear()
            self._queued = 0
            self.metrics.queue_depth(0)
            jobs, self._jobs = self._jobs, []
        for seq in rest:
            if not seq.done:
                self.output.finish(seq, FinishReason.CANCELLED, error=SHUTTING_DOWN)
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(Unavailable(SHUTTING_DOWN))
        log.info("engine stopped")

    def _iteration(self, admit: list[Sequence]) -> None:
        sched, output = self.sched, self.output
        fed = sched.prefilling is not None  # (an admission feeds a new one's first chunk)
        if admit:
            output.wake_staged()  # before a prefill that may take a while
            self._admit(admit)
        elif self.runner.unsaved:  # rows of slots left in an earlier iteration: while others
            # decode, no idle moment is coming (an admission would have taken them over)
            self.runner.save_unsaved()
        sched.retire_dead()
        if sched.active:
            self.runner.step()
        sched.retire_done()
        if fed and sched.prefilling is not None:
            self.runner.prefill_next()
        if output.due(time.monotonic()):
            output.wake_staged()
        if admit or self._running != len(sched.active):
            self._running = len(sched.active)
            self.metrics.running(self._running)
        if self._jobs:
            output.wake_staged()
            self._advance_jobs()

    # --- admission and prefill -----------------------------------------------------------------
    def _admit(self, seqs: list[Sequence]) -> None:
        now = time.monotonic()
        plain, attn = [], []
        for seq in seqs:
            if not seq.restarts:  # (a restarted one was admitted and counted before)
                seq.admitted = now
                self.metrics.admitted(now - seq.submitted, len(seq.req.prompt_ids))
            req = seq.req
            seq.seed = request_seed(req.sampling.seed) if not req.sampling.greedy else None
            seq.detok = IncrementalDetokenizer(self.token_bytes)
            seq.stopper = StopMatcher(req.stopping.stop)
            constrained = req.constraint is not None
            seq.argmax_from = argmax_from(req.sampling, req.stopping, self.eos_ids, constrained)
            seq.staged = bool(self.stream_interval) and is_staged_sink(seq.handle.events)
            seq.quiet = quiet_rule(req.sampling, req.stopping, req.output, self.eos_ids,
                                   seq.staged, constrained)
            if req.resume and resume.restore(seq, self.eos_ids, self.output,
                                             step=bool(self.inexact)):
                continue  # the delivered tokens had ended it: its Complete was all that was left
            (attn if seq.wants_attention else plain).append(seq)
            if self.spec is not None:
                self.spec.admit(seq)
        self.sched.reserve(seqs)
        self.runner.prefill(plain, attn)

    def _left(self, leaving: list[tuple[int, Sequence, bool]]) -> None:
        """Finished sequences leave their slots ((slot, seq, kept) each): their rows go to the
        prefix cache (the runner's ``cache_tokens``), and their n-gram indexes are let go
        now, in the iteration they ended in (freeing a 700-token one takes ~50 us; later it
        would fall into the next request's admission, before that one's first token)."""
        self.runner.cache_tokens(leaving)
        for _, seq, _ in leaving:
            seq.drafting = None

    def prefill_tokens(self) -> int:
        return self.sched.prefill_tokens()

    # --- scoring -------------------------------------------------------------------------------
    def _advance_jobs(self) -> None:
        """One model call for the oldest Score job (jobs share the thread with decoding)."""
        job = self._jobs[0]
        try:
            if job.handle.cancelled or (job.req.deadline is not None
                                        and time.monotonic() >= job.req.deadline):
                raise concurrent.futures.CancelledError()
            if job.steps is None:
                job.steps = score_steps(
                    self.lm, job.req, self.chunk_tokens, share=self.score_shares,
                    pool=ScorePool(self.prefix, lambda n: self._metrics.prefix_hit(n),
                                   self.score_keep)
                    if self.score_shares and self.prefix is not None else None)
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

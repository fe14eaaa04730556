"""Scheduling: which sequences run, in which KV slots, and how their prompts are cut.

The queue (bounded: a full one refuses at once), admission into free slots (up to
``max_batch``), the prefill groups and chunk sizes, and retirement: a finished, cancelled or
expired sequence leaves its slot within one step, the last slot moving into the hole (the
cache's ``move``), and the cache gives back what long sequences left. Active sequence ``i``
lives in KV slot ``i``.

A prompt longer than one prefill call (``interleave``) is fed a chunk per engine iteration
(``Prefilling``, in the slot after the active ones), the active sequences taking a step
between its chunks: a long prompt no longer stops every stream for its whole prefill. Its
rows are the ones the uninterrupted prefill makes (the same chunks, in order). One long
prompt at a time: the shorter ones admitted with it are prefilled first, those arriving
while it is fed are admitted beside it (its slot moves up past theirs), the next long one
waits for its first token. Not thread-safe: the engine calls the queue side under its lock.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable

from .domain import FinishReason, QueueFull
from .interfaces import KVCache
from .output import OutputProcessor
from .sequence import Sequence

# padding (tokens) a prefill group takes on rather than make another call, on the CPU
# provider: a call costs about as much as this many more tokens in one (6M and 100M bench
# models, fp32, 2 cores: a one-token call ~1 ms / ~15 ms, each further token ~0.08 ms / ~1.3
# ms). Not measured on CUDA, where a call's tokens cost far less beside its fixed cost: there
# a group pads as before, up to the chunk (``Scheduler.pad_tokens`` None)
PAD_TOKENS = 12
# a request whose time limit passed while it waited for a slot (its FinishEvent's error: the
# gRPC caller gets RESOURCE_EXHAUSTED, an HTTP one 429, both retryable, not an empty success)
QUEUED_OUT = ("the server is at capacity: the request waited {seconds:.1f} s for a batch slot, "
              "up to its time limit, and never started; retry later")


@dataclass
class Prefilling:
    """A sequence whose prompt goes in a chunk per iteration, in the slot after the active
    ones: ``at`` = its rows so far, ``step`` = its chunk (set at admission, so that its
    prompt is cut as one uninterrupted prefill would have cut it)."""
    seq: Sequence
    at: int
    step: int


# ``--prefill-chunk-tokens 0`` (the default): prefill calls of up to this many tokens, never
# fewer than the logits cap's chunk
AUTO_PREFILL_TOKENS = 512


class Scheduler:
    def __init__(self, kv: KVCache, *, max_batch: int, max_queue: int, max_seq_len: int,
                 n_heads: int, vocab_size: int, score_chunk_floats: int,
                 prefill_chunk_tokens: int | None, output: OutputProcessor):
        self.kv = kv
        self.max_batch, self.max_queue, self.max_seq_len = max_batch, max_queue, max_seq_len
        self.output = output
        self.n_heads = n_heads
        # tokens per chunk where every row's logits come back: (chunk x vocab) under the cap
        self.chunk_tokens = max(1, score_chunk_floats // vocab_size)
        self.score_chunk_floats = score_chunk_floats
        # tokens per generation prefill call where only the last row's logits come back: as
        # asked, 0 = auto (``AUTO_PREFILL_TOKENS``); None: the runner returns every row's
        # (``prefill_tokens``)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # chunks sized for the model's whole context, not the cache's capacity now (which the
        # batch's other requests set): a prompt is then split alike whatever runs beside it
        # (artifacts whose rows depend on the split: server.rounding)
        self.fixed_chunks = False
        # a sequence that asks for attention runs in a batch of its own: the diagnostics graph
        # a step takes for it would move its neighbours' logits (server.rounding)
        self.attention_alone = False
        # the padding a prefill group takes on rather than make another call (None: any, as
        # long as B x T fits the chunk; the engine's choice by provider)
        self.pad_tokens: int | None = PAD_TOKENS
        self.active: list[Sequence] = []  # active[i] lives in KV slot i
        # long prompts fed a chunk per iteration (the engine's choice: fused graphs); the one
        # being fed lives in slot len(active)
        self.interleave = False
        self.prefilling: Prefilling | None = None
        # called as on_leave([(slot, seq, kept), ...]) with the sequences finished at once,
        # before their slots are given up (the prefix cache keeps their rows); kept: no
        # compaction move will write into the slot
        self.on_leave: Callable[[list[tuple[int, Sequence, bool]]], None] | None = None
        self.waiting: collections.deque[Sequence] = collections.deque()

    # --- the queue (under the engine's lock) ---------------------------------------------------
    def enqueue(self, seq: Sequence) -> None:
        # a sequence that has finished (its caller may already hold the Complete) frees its
        # slot now, not at the end of the engine's iteration: otherwise a caller who sends the
        # next request the moment its stream ends can be told RESOURCE_EXHAUSTED
        busy = sum(not s.done for s in list(self.active))  # list(): one atomic copy
        busy += self.prefilling is not None
        free = max(0, self.max_batch - busy)
        if len(self.waiting) - free >= self.max_queue:
            raise QueueFull(f"the server is at capacity ({self.max_queue} requests queued); "
                            f"retry later")
        self.waiting.append(seq)  # (with ``attention_alone`` a batch may hold fewer than
        # max_batch for a while: up to max_batch - 1 more than max_queue wait then)

    def take_admissions(self) -> list[Sequence]:
        """End queued requests that were cancelled or ran out of time; pop the ones that fit."""
        if not self.waiting:
            return []
        now = time.monotonic()
        keep: collections.deque[Sequence] = collections.deque()
        for seq in self.waiting:
            if seq.handle.cancelled:
                self.output.finish(seq, FinishReason.CANCELLED)
            elif seq.req.deadline is not None and now >= seq.req.deadline:
                # never started: capacity, not the request (the gRPC caller's own deadline
                # is still DEADLINE_EXCEEDED); a restarted one had started (resume.restart)
                self.output.finish(seq, FinishReason.TIME_LIMIT, error="" if seq.restarts
                                   else QUEUED_OUT.format(seconds=now - seq.submitted))
            else:
                keep.append(seq)
        self.waiting = keep
        admit: list[Sequence] = []
        fed = self.prefilling is not None  # (it holds a slot)
        one_long = not fed  # long prompts: one at a time, the others keep their turn
        skipped: list[Sequence] = []
        while self.waiting and len(self.active) + len(admit) + fed < self.max_batch:
            if self.attention_alone and not self._fits_alone(admit):
                break
            if self.interleave and self.long(self.waiting[0]):
                if not one_long:
                    skipped.append(self.waiting.popleft())
                    continue
                one_long = False
            admit.append(self.waiting.popleft())
        self.waiting.extendleft(reversed(skipped))
        return admit

    def long(self, seq: Sequence) -> bool:
        """More prompt than one prefill call takes (fed a chunk per iteration)."""
        return len(seq.prefill_ids) > self.prefill_tokens()

    def _fits_alone(self, admit: list[Sequence]) -> bool:
        """With ``attention_alone``: the next waiting sequence may join the batch (neither it
        nor a sequence in the batch asks for attention, or the batch is empty; the queue keeps
        its order)."""
        batch = [*self.active, *admit]
        return not batch or not (self.waiting[0].wants_attention
                                 or any(s.wants_attention for s in batch))

    # --- prefill -------------------------------------------------------------------------------
    def reserve(self, admitted: list[Sequence]) -> None:
        """Room for every admitted request's prompt and new tokens (a growing cache grows now,
        once, instead of copying its buffers in the middle of decoding)."""
        self.kv.reserve(max(s.rows(self.max_seq_len) for s in (*self.active, *admitted)))

    def prefill_tokens(self) -> int:
        """Tokens per generation prefill call. ``chunk_tokens`` (the logits cap) where the
        runner computes every row's logits; where it computes the last row's only,
        ``prefill_chunk_tokens`` as long as the call's attention scores stay under the same
        cap (onnxruntime's CPU GroupQueryAttention holds chunk x heads x cache-rows floats),
        but never fewer than asked or than the logits cap's, whichever is smaller: a chunk
        below the logits cap's is asked for (shorter pauses for the streams running beside a
        long prompt, more calls for it). 0: up to ``AUTO_PREFILL_TOKENS``, never fewer than
        the logits cap's."""
        asked = self.prefill_chunk_tokens
        if asked is None:
            return self.chunk_tokens
        rows = self.max_seq_len if self.fixed_chunks else max(1, self.kv.capacity)
        by_scores = self.score_chunk_floats // (self.n_heads * rows)
        if not asked:
            return max(self.chunk_tokens, min(AUTO_PREFILL_TOKENS, by_scores))
        return max(min(self.chunk_tokens, asked), min(asked, by_scores))

    def prefill_groups(self, plain: list[Sequence], todo: Callable[[Sequence], int] | None = None
                       ) -> list[list[Sequence]]:
        """Batched prefill groups, shortest first, so that B x T stays under the chunk and a
        sequence joins a group only where the padding it adds to the others (rows are padded
        to the longest) costs less than a call of its own (``pad_tokens``). ``todo``: a
        sequence's tokens to prefill (by default its whole ``prefill_ids``; less after a
        cached prefix)."""
        chunk = self.prefill_tokens()
        size = {id(s): min(todo(s) if todo else len(s.prefill_ids), chunk) for s in plain}
        plain = sorted(plain, key=lambda s: size[id(s)])
        groups: list[list[Sequence]] = []
        group: list[Sequence] = []
        for seq in plain:
            t = size[id(seq)]
            pad = len(group) * (t - size[id(group[-1])]) if group else 0
            if group and ((len(group) + 1) * t > chunk or
                          (self.pad_tokens is not None and pad > self.pad_tokens)):
                groups.append(group)
                group = []
            group.append(seq)
        if group:
            groups.append(group)
        return groups

    # --- leaving -------------------------------------------------------------------------------
    def retire_dead(self) -> None:
        """End the active sequences that were cancelled or ran out of time; free their slots."""
        now = time.monotonic()
        dead = False
        for seq in self.active:
            if self._ended(seq, now):
                dead = True
        if self.prefilling is not None and self._ended(self.prefilling.seq, now):
            self.kv.clear(len(self.active))  # (a prompt's first rows: nothing keeps them)
            self.prefilling = None
        if dead:
            self.retire_done()

    def _ended(self, seq: Sequence, now: float) -> bool:
        """Whether ``seq`` is done, ending it first where it was cancelled or ran out of
        time."""
        if seq.done:
            return True
        if seq.handle.cancelled:
            self.output.finish(seq, FinishReason.CANCELLED)
            return True
        if seq.req.deadline is not None and now >= seq.req.deadline:
            self.output.finish(seq, FinishReason.TIME_LIMIT)
            return True
        return False

    def retire_done(self) -> None:
        gone = [i for i, s in enumerate(self.active) if s.done]
        fed = self.prefilling is not None
        if gone and self.on_leave is not None:
            # the moves below write into slots < stay only (a prompt being fed: <= stay)
            stay = len(self.active) - len(gone) + fed
            self.on_leave([(i, self.active[i], i >= stay) for i in gone])
        left = [self.active[i] for i in gone]
        was = len(self.active)
        for i in reversed(gone):  # highest first: the last slot is never one still to remove
            last = len(self.active) - 1
            if i != last:
                self.kv.move(last, i)
                self.active[i] = self.active[last]
            self.active.pop()
        if gone and fed:  # the prompt being fed follows the active ones
            self.kv.move(was, len(self.active))
        if gone:  # give back the memory long sequences left (their slots are free now); an
            # emptied batch keeps the room the sequences that just left had (a client sending
            # requests one after another would otherwise shrink and regrow the buffers, with
            # new bindings, every request: ~6 of them per request on the trained model)
            keep = [*self.active, *([self.prefilling.seq] if fed else [])] or left
            self.kv.shrink_to_fit(len(self.active) + fed,
                                  max((s.rows(self.max_seq_len) for s in keep), default=0))

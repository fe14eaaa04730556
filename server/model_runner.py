"""The engine's model calls: what the scheduler decided, run on the runner (vLLM's model
runner). Prefill of admitted sequences (batched, chunked, or from a cached prefix), one decode
step for the batch, or one verification step when sequences have speculative drafts (n-gram
lookups: ``server.speculation``; the tokens a constraint forces: ``server.fast_forward``). Each
call's logits rows go to the sampler, and the chosen tokens to the output processor.

Prefix cache: an admitted sequence takes the longest cached prefix of its prompt: whole
blocks of the pool (``server.prefix_cache``), their rows copied into its slot on the device, or
the rows its slot still has of the sequence that left it, where those are more
(``server.slot_rows``: a chat's next turn finds its whole history there); only the rest is
prefilled; its prompt's blocks are cached after the prefill, its generated tokens' when
it leaves (where no compaction move writes into its slot, once the engine is idle or at the
next step while others decode: a chat's next turn, admitted first, takes the slot's rows over
and caches its own prompt, which begins with them, after its first token). Sequences
admitted together with cached prefixes are prefilled in rounds, each round's rests in one call
(the fused graph feeds each row after its own restored rows; the portable graphs a slot at a
time): one that shares uncached blocks with another of its round waits for the next, so a
shared prefix is computed once (``prefix_cache.prefill_now``). What is prefilled is the sequence's
``prefill_ids``: its prompt, and after it the tokens a resumed request had delivered
(``server.resume``), so a stream resumed on the replica it left finds them cached.
"""
from __future__ import annotations

import time

import numpy as np

from .constraint_masks import MaskBatch
from .fast_forward import FastForward
from .interfaces import EngineMetrics, Runner
from .kept_rows import KeptRows
from .output import OutputProcessor
from .prefix_cache import prefill_now
from .rounding import diagnostics_apart
from .sampler import masked, sample_row
from .scheduler import Prefilling, Scheduler
from .sequence import Sequence
from .slot_rows import SlotRows, pending_prefixes
from .spec_verify import accepted_count, verify_row
from .speculation import Speculator
from .step_costs import StepCosts


_ARGMAX_ALL = 1 << 17  # logits floats (batch x positions x vocabulary) reduced in one argmax


class ModelRunner(KeptRows):
    def __init__(self, lm: Runner, sched: Scheduler, output: OutputProcessor,
                 metrics_of, longrope=None, prefix=None, speculator: Speculator | None = None,
                 fast_forward: FastForward | None = None, costs: StepCosts | None = None):
        self.lm, self.sched, self.output = lm, sched, output
        self._metrics_of = metrics_of  # () -> EngineMetrics (the engine's, swapped at warm-up)
        self.longrope = longrope  # LongRopeSwitch (Phi-3) or None
        self.prefix = prefix  # server.prefix_cache.PrefixCache or None
        # whether rows the attention-diagnostics graph made may be reused by plain requests:
        # not where that graph rounds apart from the plain one (server.rounding)
        self.attention_rows_reusable = not diagnostics_apart(lm)
        self.slot_rows = SlotRows() if prefix is not None else None  # (with the cache only)
        # free slots whose kept rows are still to be copied into the prefix cache: slot ->
        # (the KV cache, the tokens of its rows) (``cache_tokens``)
        self._unsaved: dict[int, tuple[object, list[int]]] = {}
        self.spec = speculator
        self.ff = fast_forward
        self.costs = costs if costs is not None else StepCosts()  # (the drafters' figures)
        self.masks: MaskBatch | None = None  # constrained rows' masks, made on first use
        # masks are computed while the model runs only where it runs on another device: on
        # the CPU provider onnxruntime's threads hold the cores (2 cores, 100M, batch 8: the
        # overlap made a constrained decode 0.88x the free one, one row at a time after the
        # call 0.95x; llguidance's parallel fill after the call 0.86x)
        self.overlap_masks = getattr(lm, "device", "cpu") != "cpu"
        self.steps = 0
        self._lone = False  # the admission being prefilled is one sequence (``_defer``)

    @property
    def metrics(self) -> EngineMetrics:
        return self._metrics_of()

    # --- prefill -------------------------------------------------------------------------------
    def prefill(self, plain: list[Sequence], attn: list[Sequence]) -> None:
        """Admitted sequences into the next free slots: their first tokens are chosen (a long
        prompt's after its chunks, one an iteration: ``prefill_next``; it goes in after the
        others admitted with it)."""
        k = len(plain) + len(attn)
        if self.sched.prefilling is not None and k:
            self._make_room(k)
        long = None
        if self.sched.interleave and self.sched.prefilling is None and k > 1:
            long = next((s for s in plain if self.sched.long(s)), None)
            plain = [s for s in plain if s is not long]
        self._lone = self.sched.interleave and k == 1 and self.sched.prefilling is None
        self._admit(plain, attn)
        if long is not None:  # (alone, the last placed: its slot follows the others')
            self.prefill([long], [])

    def _admit(self, plain: list[Sequence], attn: list[Sequence]) -> None:
        later: list[Sequence] = []
        if self.prefix is not None:
            plain, later = self._split_cached(plain)
            later = self._prefill_own(later)
        for group in self.sched.prefill_groups(plain):
            self._prefill(group, attention=False)
        while later:  # (their blocks may be cached by now) in rounds, batched: one that
            # shares uncached blocks with another of the round waits for that one's rows
            cached = [self.prefix.cached_tokens(s.prefill_ids) for s in later]
            now = prefill_now([s.prefill_ids for s in later], cached, self.prefix.block_tokens)
            todo = {id(s): len(s.prefill_ids) - c for s, c in zip(later, cached)}
            for group in self.sched.prefill_groups([s for s, go in zip(later, now) if go],
                                                   lambda s: todo[id(s)]):
                self._prefill_cached(group)
            later = [s for s, go in zip(later, now) if not go]
        for seq in attn:
            self._prefill([seq], attention=True)

    def _first(self, seq: Sequence, logits: np.ndarray, rows) -> None:
        """A sequence's prompt is in: its first token is chosen from ``logits``, or the
        delivered tokens of a resumed one are fed first, one decode step each
        (``Sequence.replay``; the steps choose nothing until the last is fed)."""
        if seq.replay:
            seq.forced.extend(seq.replay)
            seq.replay = []
            seq.feed = seq.forced.popleft()
        else:
            self.choose(seq, logits, rows)

    def _split_cached(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """(prefilled whole, after a cached prefix): a sequence goes after a cached prefix
        when part of its prompt is cached (in the pool, or in the rows a free slot kept) or
        when an earlier one of this admission begins with the same block."""
        bt = self.prefix.block_tokens
        kv, free = self.sched.kv, range(len(self.sched.active), self.sched.max_batch)
        seen: set[tuple] = set()
        batched, later = [], []
        for seq in seqs:
            ids = seq.prefill_ids
            first = tuple(ids[:bt]) if len(ids) > bt else None
            if first is not None and (first in seen or self.prefix.has_prefix(ids) or any(
                    self.slot_rows.match(kv, slot, ids) >= bt for slot in free)):
                later.append(seq)
            else:
                batched.append(seq)
            if first is not None:
                seen.add(first)
        return batched, later

    def _prefill_own(self, seqs: list[Sequence]) -> list[Sequence]:
        """Prefill first, one by one, the sequences whose rows the next free slot kept (a
        conversation's next turn, back in the slot of its last one: without this the batched
        groups would take that slot first); returns the others, in order."""
        rest = list(seqs)
        while rest:
            slot, kv = len(self.sched.active), self.sched.kv
            own = [self.slot_rows.match(kv, slot, s.prefill_ids) for s in rest]
            best = max(range(len(rest)), key=own.__getitem__)
            if not own[best]:
                break
            self._prefill_cached([rest.pop(best)], own[best])
        return rest

    def _prefill(self, group: list[Sequence], attention: bool) -> None:
        # diagnostics return (H, T, T) attention rows per layer: those keep the smaller chunk
        chunk = self.sched.chunk_tokens if attention else self.sched.prefill_tokens()
        lens = [min(len(s.prefill_ids), chunk) for s in group]
        active, kv = self.sched.active, self.sched.kv
        lo = len(active)  # the group takes the next free slots, in order
        if self.slot_rows is not None:
            self._take(kv, range(lo, lo + len(group)))
        res = self.lm.prefill(kv, lo, [s.prefill_ids[:n] for s, n in zip(group, lens)],
                              attention=attention, last=True)  # (1, V) each: the last row
        prompts: list[tuple[int, Sequence]] = []  # cached together after the first tokens
        for b, (seq, n) in enumerate(zip(group, lens)):
            ids = seq.prefill_ids
            if n < len(ids) and not attention and self._defer(seq, n):
                continue
            active.append(seq)
            if n < len(ids):
                if attention:  # the rest goes through decode steps, which carry attention
                    seq.forced.extend(ids[n:])
                    seq.forced.extend(seq.replay)
                    seq.replay = []
                    seq.feed = seq.forced.popleft()
                    continue
                last = self._extend(lo + b, ids, n)
                self._first(seq, last, None)
                prompts.append((lo + b, seq))
                continue
            rows = None
            if attention:  # the last prompt token's attention over the prompt
                rows = [(layer, h, res.attention[b][layer, h, n - 1])
                        for layer in seq.req.output.attention_layers
                        for h in seq.req.output.attention_heads]
            self._first(seq, res.logits[b][-1], rows)
            if not attention:
                prompts.append((lo + b, seq))
        self._cache_prompts(prompts)

    def _prefill_cached(self, group: list[Sequence], own: int | None = None) -> None:
        """Sequences into the next free slots, each after its prompt's longest cached prefix
        (the slot's own rows, or blocks restored from the pool); the rests are prefilled in
        one call (rows past different prefixes; a longer rest's tail in chunks after it).
        ``own``: the one sequence's rows its slot kept, when already known
        (``_prefill_own``)."""
        if len(group) > 1 and not getattr(self.lm, "prefills_after_rows", False):
            for seq in group:  # (the portable graphs' prefill takes new sequences only)
                self._prefill_cached([seq])
            return
        active = self.sched.active
        lo = len(active)
        starts = [self._restore(lo + b, seq, own) for b, seq in enumerate(group)]
        if len(group) == 1 and len(group[0].prefill_ids) - starts[0] > \
                self.sched.prefill_tokens() and self._defer(group[0], starts[0]):
            self.prefill_next()  # (its first chunk: as an uninterrupted prefill's)
            return
        active.extend(group)
        for seq, last in zip(group, self._rests(lo, group, starts)):
            self._first(seq, last, None)
        self._cache_prompts([(lo + b, seq) for b, seq in enumerate(group)])

    def _rests(self, lo: int, group: list[Sequence], starts: list[int]) -> list[np.ndarray]:
        """Each sequence's prompt after its first ``starts[b]`` rows into slot lo + b: one
        call for the group, B x T within the prefill chunk, and the tails that do not fit
        one slot at a time. Returns each one's last logits row (V,)."""
        step = self.sched.prefill_tokens() // len(group)
        S = max(min(len(s.prefill_ids) - n, step) for s, n in zip(group, starts))
        if len(group) == 1 or max(starts) + S > self.sched.max_seq_len:  # (rows are padded
            # to S: a long past's padding would pass the context, where learned and
            # sinusoidal position tables have no row) a slot at a time, as ``extend`` does
            return [self._extend(lo + b, s.prefill_ids, n)
                    for b, (s, n) in enumerate(zip(group, starts))]
        res = self.lm.prefill(self.sched.kv, lo, [s.prefill_ids[n:n + step] for s, n in
                                                  zip(group, starts)], last=True)
        return [res.logits[b][-1] if n + step >= len(s.prefill_ids) else  # (n < len: a
                self._extend(lo + b, s.prefill_ids, n + step)  # match leaves a token)
                for b, (s, n) in enumerate(zip(group, starts))]

    def _restore(self, slot: int, seq: Sequence, own: int | None) -> int:
        """``seq``'s longest cached prefix into the free ``slot``: the rows the slot kept of
        it (``own`` when known) or, where those are fewer, the pool's blocks. Returns the
        rows restored."""
        kv = self.sched.kv
        if self._unsaved:  # (another free slot's rows of this prefix: into the pool first)
            self._save(pending_prefixes(self._unsaved, kv, slot, seq.prefill_ids, self.prefix))
        blocks, n = self.prefix.match(seq.prefill_ids)
        try:
            if own is None:
                own = self.slot_rows.match(kv, slot, seq.prefill_ids)
            if own > n:
                self._take(kv, [slot], own)
                n = own
            else:
                self._take(kv, [slot])
                if n:
                    self.prefix.restore(kv, slot, blocks, n)
        finally:
            self.prefix.release(blocks)
        seq.cached_tokens = min(n, len(seq.req.prompt_ids))  # (a resume: delivered ones too)
        self.metrics.prefix_hit(n)
        return n

    def _cache_prompts(self, prompts: list[tuple[int, Sequence]]) -> None:
        """The prompts' rows ((slot, sequence) each) into the prefix cache, one device copy
        for all of a prefill group's: after their first tokens were chosen (and their callers
        woken), so the copy is not part of the time to first token; before the next sequence
        of the same admission is prefilled, so that one finds them (sequences of one group
        share no first block: ``_split_cached``)."""
        if self.prefix is not None and prompts:
            self.prefix.insert_many(self.sched.kv, [(slot, seq.prefill_ids)
                                                    for slot, seq in prompts])

    def _extend(self, slot: int, ids: list[int], start: int) -> np.ndarray:
        """Chunked prefill: feed ids[start:] to ``slot`` in chunks of ``prefill_tokens()``
        (LongRoPE's portable runner: of ``chunk_tokens``) after the slot's rows so far.
        Returns the last row of logits (V,)."""
        kv = self.sched.kv
        if self.longrope is not None:  # a prompt past its limit: long factors from row 0
            last = self.longrope.extend(self.lm, kv, slot, ids, start, self.sched.chunk_tokens)
            if last is not None:
                return last
        step = self.sched.prefill_tokens()
        for a in range(start, len(ids), step):
            chunk = np.asarray(ids[a:a + step], np.int64)
            last = self.lm.extend(kv, slot, chunk, last=True)[-1]  # (1, V) -> (V,)
        return last

    def _make_room(self, k: int) -> None:
        """The prompt being fed moves ``k`` slots up, past the ``k`` sequences admitted now
        (its rows so far with it): the active sequences keep the first slots."""
        kv = self.sched.kv
        src = len(self.sched.active)
        if self.slot_rows is not None:  # (rows the slot kept that wait for the pool: first)
            self._take(kv, [src + k])
        kv.move(src, src + k)
        kv.clear(src)

    def _defer(self, seq: Sequence, rows: int) -> bool:
        """``seq``, placed alone and last in its admission (``prefill``), whose slot (the next
        free one) holds its first ``rows`` rows, goes on a chunk per iteration
        (``Scheduler.prefilling``); False otherwise (its prompt then goes in at once)."""
        if not self._lone:
            return False
        self.sched.prefilling = Prefilling(seq, rows, self.sched.prefill_tokens())
        return True

    def prefill_next(self) -> None:
        """The next chunk of the prompt fed a chunk per iteration (the chunks ``_extend``
        would have fed, in order); after the last one the sequence joins the active ones, its
        first token chosen and its prompt's rows cached."""
        p, kv = self.sched.prefilling, self.sched.kv
        slot, ids = len(self.sched.active), p.seq.prefill_ids
        last = self.lm.extend(kv, slot, np.asarray(ids[p.at:p.at + p.step], np.int64),
                              last=True)[-1]
        p.at = min(len(ids), p.at + p.step)
        if p.at < len(ids):
            return
        self.sched.prefilling = None
        self.sched.active.append(p.seq)
        self._first(p.seq, last, None)
        self._cache_prompts([(slot, p.seq)])

    # --- decoding ------------------------------------------------------------------------------
    def step(self) -> None:
        """One model call for every active sequence: a verification step where drafts are
        worth it (n-gram drafts, the tokens constraints force), else a decode step."""
        active = self.sched.active
        t0 = time.monotonic()
        ngram = self.spec.drafts(active) if self.spec is not None else None
        drafts = self.ff.drafts(active, ngram) if self.ff is not None else ngram
        if drafts is not None:
            drafts = self._within_context(drafts)
        if drafts is not None:
            self._verify_step(drafts, ngram is not None, time.monotonic() - t0)
        else:
            self._decode_step(time.monotonic() - t0)

    def _within_context(self, drafts: list[list[int]]) -> list[list[int]] | None:
        """``drafts`` cut so that the verification's every row, padded to the longest, stays
        inside the model's context (None: no draft left, a plain step). Each drafter caps its
        own row; the padding of a row near the context's end would look up positions past the
        graph's tables (learned or sinusoidal: onnxruntime fails the call)."""
        n = len(drafts)
        room = self.lm.cfg.max_seq_len - int(max(self.sched.kv.used[:n])) - 1
        if max(map(len, drafts)) <= room:
            return drafts
        cut = [d[:room] for d in drafts] if room > 0 else []
        return cut if any(cut) else None

    def _decode_step(self, drafting: float = 0.0) -> None:
        """A plain step: one token for every active sequence. ``drafting``: the seconds the
        drafters took before it (lookups that found nothing, or drafts that did not pay):
        the ``Backoff`` charges them to speculation, the step costs leave them out."""
        active, kv = self.sched.active, self.sched.kv
        n = len(active)
        # the diagnostics graph for a row that wants attention from its last prompt token on
        # (a resumed one's replayed tokens too: the earlier call fed them through it)
        attention = any(s.wants_attention for s in active) and any(
            s.wants_attention and (not s.forced or used >= len(s.req.prompt_ids) - 1)
            for s, used in zip(active, kv.used[:n].tolist()))
        tokens = [s.feed for s in active]  # (n,) (runners take any sequence of ints)
        if self.longrope is not None:  # a LongRoPE row crossing: recomputed first (staged
            # events handed over before that refill, which may take a while)
            self.longrope.before_decode(self.lm, kv, n, lambda slot: active[slot].tokens(),
                                        self.sched.chunk_tokens,
                                        before_refill=self.output.wake_staged)
        masks = self._constrained(active)
        if masks:  # computed while the model runs on its device
            self.masks.start(masks)
        built = self._bindings_built()
        t0 = time.monotonic()
        try:
            logits, attn = self.lm.decode(kv, n, tokens, attention=attention)
        finally:
            if masks:
                self.masks.wait()
        if masks:
            self.masks.apply(logits, masks)  # the constrained rows, in place
        self.steps += 1
        now = time.monotonic()
        self.metrics.step(n, now - t0)
        # the plain greedy rows (no penalties, nothing banned at this step) take one argmax
        # over the batch (V,) rows at once: the same token sample_row would pick
        plain = [_greedy(s) for s in active]
        argmax = logits[:n].argmax(axis=1).tolist() if any(plain) else None
        for i, seq in enumerate(active):
            if seq.forced:
                seq.feed = seq.forced.popleft()
                continue
            rows = None
            if attn is not None and seq.wants_attention:
                rows = [(layer, h, attn[i][layer, h])  # (T,): the sequence's tokens so far
                        for layer in seq.req.output.attention_layers
                        for h in seq.req.output.attention_heads]
            self.choose(seq, logits[i], rows, argmax[i] if plain[i] else None,
                        premasked=bool(masks), now=now)
        # the drafters weigh whole steps: the call and the tokens' handling after it (a
        # verification walks its rows token by token, a plain step takes one argmax)
        seconds = time.monotonic() - t0
        steady = self.costs.plain_step(n, seconds, once=self._bindings_built() != built)
        if self.spec is not None:
            self.spec.backoff.plain_step(n, steady, seconds + drafting)

    def _bindings_built(self) -> int:
        """The runner's IO bindings built so far (a call that built one paid a one-time cost,
        which the step costs leave out); 0 for a runner that does not count them."""
        return getattr(self.lm, "bindings_built", 0)

    def _constrained(self, active: list[Sequence]) -> list:
        """The batch's constrained rows whose masks are made while the model runs, where it runs
        on another device and with two or more rows; [] otherwise: ``choose`` makes each row's
        mask after the call (on the CPU provider onnxruntime's threads hold the cores)."""
        if not self.overlap_masks:
            return []
        rows = [(i, s.req.constraint) for i, s in enumerate(active)
                if s.req.constraint is not None and not s.forced]
        if len(rows) < 2:
            return []
        if self.masks is None:
            self.masks = MaskBatch(self.lm.cfg.vocab_size, self.sched.max_batch)
        return rows

    def _verify_step(self, drafts: list[list[int]], ngram: bool, drafting: float = 0.0
                     ) -> None:
        """Every row feeds its token and its draft in one call; each keeps the tokens the plain
        path would have chosen (``spec_verify``), and its cache the rows of those tokens.
        ``ngram``: the n-gram speculator drafted this step (its ``Backoff`` measures it); a
        constrained row's draft is the tokens its grammar forces (``fast_forward``).
        ``drafting``: the seconds the drafts took (the lookups and their weighing): the
        ``Backoff`` charges them to the step, as speculation's own cost against a plain step
        (measured on the default trained model at batch 8: 228 us a step beside a 2.1 ms
        call, where a plain step took 1.05 ms); the step costs leave them out (when the
        weighing runs, they are paid whatever it chooses)."""
        active, kv = self.sched.active, self.sched.kv
        n = len(active)
        before = kv.used[:n].tolist()
        rows = [[s.feed, *d] for s, d in zip(active, drafts)]
        S = max(map(len, rows))
        built = self._bindings_built()
        t0 = time.monotonic()
        logits = self.lm.verify(kv, n, rows)
        self.steps += 1
        now = time.monotonic()
        self.metrics.step(n, now - t0)
        # the positions' argmax in one call where the logits are few (else a quiet row's
        # in one call per row, the others' as the walk reaches them)
        every = logits.argmax(axis=2).tolist() if n * S * logits.shape[2] <= _ARGMAX_ALL \
            else None
        emitted = forced = 0
        for i, (seq, draft) in enumerate(zip(active, drafts)):
            tops = every[i] if every is not None else None
            toks = None
            if seq.quiet is not None and len(seq.generated) >= seq.quiet.start:
                if tops is None:
                    tops = logits[i, :len(draft) + 1].argmax(axis=1).tolist()
                toks = self._quiet_walk(seq, draft, tops, now)
            if toks is None:
                toks = verify_row(logits[i], draft, self._taker(seq, tops, now),
                                  lambda tok, s=seq: s.done)
            kv.truncate(i, before[i] + len(toks))
            emitted += len(toks)
            accepted = accepted_count(draft, toks)
            if seq.req.constraint is not None:  # (constrained rows never draft n-grams)
                if draft:
                    forced += accepted
                    self.ff.record(len(draft), accepted)
                    self.metrics.fast_forwarded(accepted)
            elif self.spec is not None:
                self.spec.record(seq, len(draft), accepted)
                self.metrics.speculated(len(draft), accepted)
        seconds = time.monotonic() - t0  # (the whole step, as the plain one's)
        self.costs.verify_step(n, S, seconds, once=self._bindings_built() != built)
        if ngram:
            self.spec.backoff.verify_step(n, seconds + drafting, emitted - forced)

    def _quiet_walk(self, seq: Sequence, draft: list[int], tops: list[int], now: float
                    ) -> list[int] | None:
        """``verify_row``'s walk for a row past its ``stopping.QuietRule``'s start (greedy), from
        its positions' argmax ``tops``: the agreeing draft tokens and the one after them, each
        recorded quietly, where none of them can end the sequence (else None: the walk
        token by token). The same tokens: each is its position's argmax, and a token that
        leaves the sequence going stops nothing."""
        rule, k = seq.quiet, len(seq.generated)
        toks = tops[:accepted_count(draft, tops) + 1]
        if k + len(toks) >= rule.max_new_tokens or not rule.ends.isdisjoint(toks):
            return None
        for tok in toks:
            self.output.hold(seq, tok, now)
        return toks

    def _taker(self, seq: Sequence, tops: list[int] | None, now: float):
        """The token ``seq`` takes from a verification's row at position j (its plain path's
        choice); ``tops``: each position's argmax, when already reduced."""
        def take(j: int, row: np.ndarray) -> int:
            tok = None
            if _greedy(seq):
                tok = tops[j] if tops is not None else int(row.argmax())
            return self.choose(seq, row, None, tok, now=now)
        return take

    def choose(self, seq: Sequence, raw: np.ndarray, attention, tok: int | None = None,
               premasked: bool = False, now: float | None = None) -> int:
        """The next token of ``seq`` from its logits row (V,), handed to the output processor
        and returned. ``tok``: already chosen by a greedy argmax (``_greedy``), which a quiet
        step (``stopping.QuietRule``, given ``now``) only records; else sampled from the row
        (``premasked``: its constraint's mask is applied)."""
        if tok is not None:
            if now is not None and seq.quiet is not None and \
                    seq.quiet.quiet(tok, len(seq.generated)):
                self.output.hold(seq, tok, now)
                return tok
        else:
            if not premasked:
                raw = masked(raw, seq.req)
            tok = sample_row(raw, seq.req, seq.generated, seq.seed, self.output.eos_ids)
        self.output.accept(seq, tok, raw, attention)
        return tok


def _greedy(seq: Sequence) -> bool:
    """Whether ``seq``'s next token is the plain argmax of its logits (no penalties, nothing
    banned at this step, unconstrained: ``stopping.argmax_from``)."""
    return seq.argmax_from is not None and len(seq.generated) >= seq.argmax_from

"""What the model runner does with the rows sequences leave behind (its ``KeptRows`` role):
a leaving sequence's rows go into the prefix cache (``cache_tokens``) and stay in its slot
(``server.slot_rows``); where no compaction move writes into that slot, the copy into the pool
waits (``unsaved``) until the engine is idle (``idle_step``) or a sequence is admitted into the
slot (``_take``): a chat's next turn takes the rows over instead.

A mixin of ``ModelRunner``, which holds the state it reads: ``prefix`` (the pool or None),
``sched`` (its KV cache), ``slot_rows``, ``_unsaved`` (free slot -> (the KV cache, the tokens of
its rows)) and ``attention_rows_reusable``. Not thread-safe: the engine's thread owns it.
"""
from __future__ import annotations

from .sequence import Sequence


class KeptRows:
    def cache_tokens(self, leaving: list[tuple[int, Sequence, bool]]) -> None:
        """Leaving sequences' rows (prompt and generated tokens) into the prefix cache ((slot,
        seq, kept) each: one device copy for those copied now); their slots keep them too
        (``server.slot_rows``). ``kept``: no compaction move writes into the slot, so the copy
        into the pool can wait (``unsaved``) until the engine has nothing else to do, or a
        sequence is admitted into that slot: one that continues these tokens (a chat's next
        turn) takes the rows over and caches its prompt, which begins with them, after its
        first token, so the copy is not made before it."""
        if self.prefix is None:
            return
        kv = self.sched.kv
        rows = [(slot, self._reusable_tokens(seq), kept) for slot, seq, kept in leaving]
        now = [(slot, tokens) for slot, tokens, kept in rows if tokens is not None and not kept]
        if now:
            self.prefix.insert_many(kv, now)
        for slot, tokens, kept in rows:
            self.slot_rows.left(kv, slot, tokens)
            if tokens is not None and kept:
                self._unsaved[slot] = (kv, tokens)

    def _reusable_tokens(self, seq: Sequence) -> list[int] | None:
        """The tokens of a leaving sequence's rows, or None where other requests must not
        reuse them: not all known (a prompt tail not fed), or made by the diagnostics graph
        where it rounds apart from the plain one."""
        if seq.forced or (seq.wants_attention and not self.attention_rows_reusable):
            return None
        return seq.tokens()

    @property
    def unsaved(self) -> bool:
        """Some free slot's rows wait to be copied into the prefix cache."""
        return bool(self._unsaved)

    def save_unsaved(self) -> None:
        """Copy every free slot's rows that wait for it into the prefix cache."""
        self._save(list(self._unsaved))

    def drop_unsaved(self) -> None:
        """The KV cache is being replaced (a failed iteration): its waiting rows are not
        copied, and the old cache is not held for them."""
        self._unsaved.clear()

    @property
    def idle_work(self) -> bool:
        """Something to do while no request is here: rows that wait for the prefix cache, or
        pool blocks to make resident ahead of use (``PrefixCache.warm``)."""
        return bool(self._unsaved) or (self.prefix is not None and self.prefix.warm_pending)

    def idle_step(self) -> None:
        """One piece of the idle work: the waiting rows into the prefix cache, else one chunk
        of pool blocks made resident (~0.5 ms at most: the engine looks for requests between
        two pieces)."""
        if self._unsaved:
            self.save_unsaved()
        elif self.prefix is not None:
            self.prefix.warm()

    def _save(self, slots: list[int]) -> None:
        """The rows the free ``slots`` still retain of the tokens that wait for the prefix
        cache, into it: one device copy (a free slot's ``used`` is 0, set to its rows while
        they are copied)."""
        kv, used, items = self.sched.kv, {}, []
        try:
            for slot in slots:
                was, tokens = self._unsaved[slot]
                rows = int(kv.retained[slot]) if was is kv else 0  # (a new cache: gone)
                if self.prefix.cacheable(rows):
                    used[slot] = int(kv.used[slot])
                    kv.used[slot] = rows
                    items.append((slot, tokens[:rows]))
            if items:
                self.prefix.insert_many(kv, items)
        finally:  # (``unsaved`` is false only once the copy is done)
            for slot, n in used.items():
                kv.used[slot] = n
            for slot in slots:
                del self._unsaved[slot]

    def _take(self, kv, slots, rows: int = 0) -> None:
        """Sequences are admitted into ``slots``, each taking over the first ``rows`` rows its
        slot retains: the rows that wait for the prefix cache go there first (one copy for
        all the slots), unless the ones taken over hold all the rows the pool would cache of
        them (the sequence's prompt, cached after its first token, begins with them)."""
        save = []
        for slot in slots:
            waiting = self._unsaved.get(slot)
            if waiting is None:
                continue
            cached = self.prefix.cacheable(min(len(waiting[1]), int(kv.retained[slot])))
            if rows >= cached and waiting[0] is kv:
                del self._unsaved[slot]
            else:
                save.append(slot)
        self._save(save)
        for slot in slots:
            self.slot_rows.take(kv, slot, rows)

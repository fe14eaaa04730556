"""Score's side of the prefix cache: a Score sequence's rows go into the pool with the
log-probabilities it computed at them (``PrefixCache.keep_scores``), and a later Score
sequence that begins with them takes both (``PrefixCache.scored_match``): the rows of all but
the last cached token are restored into its slot, the log-probabilities of the cached tokens
are copied, and the feed starts at the last cached token (whose row's logits give the next
token's log-probability). lm-evaluation-harness's requests, one at a time, repeat a few-shot
header or a question's context in each: each is computed once while the pool holds it.

A block keeps log-probabilities only where a Score computed them (a generation's prefill
computes logits for its last rows only), with that request's count of top tokens (a request
asking for more top tokens computes its tokens again, and keeps its own). Exact as the
prefix cache is: a row and a token's log-probability depend on the tokens up to it only."""
from __future__ import annotations

from typing import Callable

import numpy as np

# Score sequences in a row that found nothing kept before keeping backs off, and then one in
# this many still kept (a probe: a repeated context is caught again by the next that takes it)
KEEP_AFTER_MISSES = 32
PROBE_EVERY = 8


class KeepPolicy:
    """Whether a Score's rows are kept: keeping costs a device copy a request (one-off
    requests 1.10x / 1.06x the time at 32 / 128 tokens on the 6M model, 1.03x on the 100M:
    bench/results/score-keep.md), and pays only where a later Score takes them. After
    ``after`` takes in a row found nothing kept, only one keep in ``every`` is made, until a
    take finds something again: a take that finds a context saves about a request's work, a
    keep costs 3-10% of one, so below about one hit in 10-30 requests keeping loses, and 32
    misses in a row is well below. One per engine (Score jobs come and go); not thread-safe
    (the engine's thread)."""

    def __init__(self, after: int = KEEP_AFTER_MISSES, every: int = PROBE_EVERY):
        self.after, self.every = after, every
        self.misses = 0  # takes in a row that found nothing kept
        self.skipped = 0  # keeps not made (backed off)

    def taken(self, hit: bool) -> None:
        self.misses = 0 if hit else self.misses + 1

    def keep(self) -> bool:
        backed = self.misses - self.after
        if backed < 0 or backed % self.every == 0:
            return True
        self.skipped += 1
        return False


class ScorePool:
    """Score's use of the engine's ``PrefixCache`` (``prefix``). ``on_hit(tokens)``: the
    tokens a take served (the rows restored, or a wholly kept sequence's tokens), once per
    take however many sequences share it (the hit counter). ``policy``: the engine's
    ``KeepPolicy`` (None: every Score's rows are kept)."""

    def __init__(self, prefix, on_hit: Callable[[int], None] | None = None,
                 policy: KeepPolicy | None = None):
        self.prefix, self.on_hit, self.policy = prefix, on_hit, policy

    def take(self, kv, slot: int, ids, scored: list, whole: bool) -> int:
        """Restore into the empty ``slot`` the cached rows of ``ids`` whose log-probabilities
        a Score kept, and record those log-probabilities into each of ``scored``
        (``_Scored`` of sequences that begin with ``ids``). Returns where the feed starts:
        the rows restored (the last cached token is fed again, for its row's logits), 0 with
        nothing cached; ``whole`` and every token of ``ids`` cached: len(ids), nothing
        restored (nothing to feed: the sequence is scored)."""
        prefix, n = self.prefix, scored[0].n_top
        blocks, scores = prefix.scored_match(ids, n)
        if self.policy is not None:
            self.policy.taken(bool(blocks))
        try:
            if not blocks:
                return 0
            covered = len(blocks) * prefix.block_tokens
            lps = np.concatenate([b.lps for b in scores])[1:covered]
            top_i = np.concatenate([b.top_ids[:, :n] for b in scores])[1:covered] if n \
                else None
            top_l = np.concatenate([b.top_lps[:, :n] for b in scores])[1:covered] if n \
                else None
            start = covered if whole and covered == len(ids) else \
                prefix.restore(kv, slot, blocks, covered - 1)
            for s in scored:
                s.lps[:covered - 1] = lps
                if n:
                    s.tops_i[:covered - 1], s.tops_l[:covered - 1] = top_i, top_l
                s.cached = start
            if self.on_hit is not None:
                self.on_hit(start)
            return start
        finally:
            prefix.release(blocks)

    def keep(self, kv, items: list) -> None:
        """After their calls: the rows of each (slot, ids, scored) (the slot's first rows are
        ``ids``' rows) into the pool, one device copy for all, on probation (evicted before
        other blocks until a request takes them), and their log-probabilities with the
        blocks; none where the policy has backed off."""
        if not items or (self.policy is not None and not self.policy.keep()):
            return
        self.prefix.insert_many(kv, [(slot, ids) for slot, ids, _ in items], probation=True)
        for _, ids, s in items:
            self.prefix.keep_scores(ids, s.lps, s.tops_i, s.tops_l)

"""Fast-forward of the tokens a constraint forces: they become the constrained row's draft.

Where the grammar allows only one continuation (``{"name": "`` after the opening brace of a
schema with fixed keys, the rest of a choice once its first token decides it), llguidance's
``compute_ff_tokens`` (``Constraint.forced``) lists those tokens. Instead of one decode step per
token, the row feeds them as its draft in the engine's verification call
(``ModelRunner._verify_step``, shared with the n-gram drafts of other rows), and
``spec_verify.verify_row`` keeps each one only if the plain path's own sampling of that
position picks it: the mask after the previous accepted token, banned ids, penalties and the
seeded draw of that position. So outputs are token-identical with fast-forward on and off,
greedy and seeded (a forced token that the token-level mask would not pick, e.g. another
tokenization of the same text, is rejected like any wrong draft).

It is independent of n-gram speculation (``--speculative-tokens``) and of its ``Backoff``
(forced tokens are accepted almost always: that pause measures the n-gram drafts' gain). What
it does weigh is the call's shape: the verification pads every row to the longest one, and on
the CPU provider (2 cores, 100M, batch 8) a call of 17 positions a row cost ~9x a plain step
(5 positions ~2.8x, 2 ~1.5x) against ~1.5x at batch 1. So at batch 1 the whole forced run
goes (one call of 1 + K positions is a short prefill: cheaper per token than K + 1 steps on
any device); in a batch the draft length is the one that maximises the expected tokens per
second, from what a call of that many positions a row costs over a plain step at that batch
size (``StepCosts.relative``, the figures the n-gram speculator weighs too; unmeasured: the
whole run, which measures it).
"""
from __future__ import annotations

from .ngram import MAX_K
from .sequence import Sequence
from .step_costs import StepCosts

_FORGET = 0.9  # what a batch size's verifications cost beyond a plain step shrinks each time
# it refuses a forced run, so that a figure inflated by one slow call is measured again after a
# few refusals


class FastForward:
    """The engine's forced-token drafts: ``drafts(active, base)`` before a step, ``record``
    per row verified; the steps' seconds come from ``costs`` (``server.step_costs``, which the
    model runner updates)."""

    def __init__(self, max_seq_len: int, k_max: int = MAX_K, costs: StepCosts | None = None):
        if not 1 <= k_max <= MAX_K:
            raise ValueError(f"fast-forward tokens must be in [1, {MAX_K}], got {k_max}")
        self.k_max, self.max_seq_len = k_max, max_seq_len
        self.costs = costs if costs is not None else StepCosts()
        self.drafted = self.accepted = 0  # totals (tests, logs)

    def forced(self, seq: Sequence) -> list[int]:
        """The tokens ``seq``'s constraint forces next, within its room (the draft's tokens and
        the one after them are new tokens of the sequence) and ``k_max``."""
        c = seq.req.constraint
        if c is None or seq.done:
            return []
        n_gen = len(seq.generated)
        room = min(seq.req.stopping.max_new_tokens - n_gen,
                   self.max_seq_len - len(seq.req.prompt_ids) - n_gen) - 1
        if room <= 0:
            return []
        return c.forced()[:min(room, self.k_max)]

    def drafts(self, active: list[Sequence],
               base: list[list[int]] | None) -> list[list[int]] | None:
        """Each row's draft: a constrained row's forced tokens, another row's ``base`` draft
        (the n-gram speculator's; None: no row drafts), or None for a plain step."""
        # rows with attention diagnostics or feeding a prompt tail take the plain step (the
        # diagnostics graph), and the whole batch with them
        if any(s.wants_attention or s.forced for s in active):
            return base
        forced = [self.forced(s) for s in active]
        lens = [len(f) for f in forced if f]
        if not lens:
            return base
        k_base = max(map(len, base)) if base is not None else 0
        k = self.cap(len(active), lens, k_base)
        if not k:
            return base
        out = [list(b) for b in base] if base is not None else [[] for _ in active]
        for i, f in enumerate(forced):
            if f:
                out[i] = f[:k]
        return out

    def cap(self, n: int, lens: list[int], k_base: int = 0) -> int:
        """The forced drafts' length this step at batch size ``n`` (0: none), given the forced
        runs' lengths ``lens`` and the longest other draft ``k_base`` (positions already paid):
        the one with the most expected tokens per second (forced tokens count as accepted)."""
        top = max(lens)
        if n == 1:
            return top
        if not self.costs.measured(n):
            return top  # not measured at this batch size: the call measures it
        cost = self.costs.relative  # (a call of S positions a row over a plain step)
        best_k, best = 0, n / cost(n, 1 + k_base)
        for k in sorted(set(lens)):
            rate = (n + sum(min(m, k) for m in lens)) / cost(n, 1 + max(k, k_base))
            if rate > best:
                best_k, best = k, rate
        if not best_k:
            self.costs.forget(n, _FORGET)
        return best_k

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

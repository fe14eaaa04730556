"""Speculative decoding without a draft model, as the engine uses it: which sequences draft,
how long their drafts are, and when speculation is paused because it would lose speed.

Drafts come from n-gram prompt lookup over each sequence's own tokens (``server.ngram``);
one call of the fused graph verifies every row's draft (``FusedLM.verify``: rows without a
draft feed their one token in the same call), and ``server.spec_verify`` keeps exactly the
tokens the plain path would have produced (greedy and seeded sampling alike).

Four things keep it from costing speed:
- per sequence, lookups that find nothing are made less often (every 2, then 4 steps), so a
  sequence that never repeats itself costs little Python;
- per step, the draft length is weighed for the whole batch (``ngram.best_positions``): each
  row's draft is expected to yield 1 + a + ... + a^K tokens (a: the acceptance per draft token
  measured for drafts that followed as long an n-gram match, that sequence's own drawn towards
  the engine's: ``ngram.AdaptiveK``), the call costs what the engine measured for
  that many positions a row at that batch size (``server.step_costs``), and the step takes the
  length at which the rows gain most in geometric mean (all rows' drafts cut to it: the
  padding is paid anyway; a row without a draft is not slowed for the others' sake unless
  they gain more, in ratio), or a plain step when no draft pays;
- per engine, ``Backoff``: the tokens a window of steps yields per second while speculation is
  on (``_WINDOW`` verifications with the plain steps among them, or ``_WINDOW_STEPS`` steps
  in all: the plain steps pay for the lookups and the n-gram indexes, and the one after a
  verification for the change of shape) are compared with the plain step's at the same batch
  size (two plain steps are taken now and then to keep that figure fresh). Where the windows
  yield fewer (a moving average of their gains: one window's is noisy), speculation pauses
  at that batch size only (the batch is compute-bound, or the drafts are poor), for longer
  each time it happens again in a row: up to ``_PAUSE_MAX_SECONDS`` of plain steps, so that
  where speculation never pays it stays off, its indexes unbuilt, nearly all the time, and
  where it begins to pay it is back within seconds; once the trend gains, each gaining
  window halves the next pause. A window of lookups that found no draft worth verifying
  pauses it unless verifications have been gaining at that batch size: where they pay, the
  lookups are the price of the next drafts (a pause there missed them: the default trained
  model at batch 1 drafted 40% less). A request's own draft source (OpenAI's ``prediction``)
  drafts through a pause, its row alone; the pause goes on for the others. Sums over a
  window, not step by step, so that one step slowed by another process does not switch it
  off. (Before 2026-12-05 only verifications were weighed and a pause held at every batch
  size: on the default trained model at batch 8, speculation drafting next to nothing cost
  3-12% against it off, most of it the n-gram indexes of prompts and generated tokens.);
- the costs are measured per batch size, so a batch that is compute-bound pays for no draft
  it cannot afford.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .ngram import AdaptiveK, MatchRates, NgramIndex, best_positions
from .sequence import Sequence
from .step_costs import StepCosts

_REFRESH = 32  # verification steps between two refreshes of the plain figure at a batch size
_WINDOW = 16  # verification steps whose tokens and seconds are weighed together (with the
_WINDOW_STEPS = 64  # plain steps among them), or this many steps in all
_JUDGED = 4  # a window with this many verifications says whether they pay at its batch size
_TREND = 0.5  # the weight of the earlier such windows in its trend
_PAUSE = 16  # plain steps of a first pause (at that batch size); doubled while windows keep
_PAUSE_MAX_SECONDS = 2.0  # losing, up to this many seconds of plain steps there
_MAX_SKIP = 4  # steps between lookups of a sequence whose lookups keep finding nothing
_INDEX_CHUNK = 1024  # prompt tokens indexed per step (random tokens, all n-grams distinct:
# 1,000 took 1-2 ms, 16,000 25-47 ms in one step of every sequence in the batch)
_MAX_REST_LOG2 = 3  # at most 7 steps between two weighings while nothing pays
_PRIOR_DECAY = 0.99  # weight of the earlier verifications in the engine's acceptance
_ENGINE_FADE = 0.98  # ... and per unused draft of that match length
_UNTRIED = 0.8  # the acceptance a match length is weighed with before its drafts were measured
_WORTH = 1.0  # speculation goes on while it yields at least this x the plain tokens/s


@dataclass
class Drafting:
    """A sequence's speculation state: its n-gram index and draft length."""
    k: AdaptiveK
    # what the index holds before the generated tokens: the prompt, after the request's
    # lookup ids (OpenAI's ``prediction``) where it has some
    source: list[int]
    index: NgramIndex | None = None  # built from its first lookup on (after its first
    # token), ``_INDEX_CHUNK`` prompt tokens a step
    n: int = 0  # the matched n-gram length of its latest draft
    indexed: int = 0  # generated tokens already in the index
    empty: int = 0  # lookups in a row that found no draft
    skip: int = 0  # steps left before the next lookup
    from_prediction: int = 0  # how many of its latest draft's first tokens were copied
    # from the request's lookup ids (``source``'s first tokens)


class Backoff:
    """Whether a step at batch size n should verify drafts, from measured step rates (the plain
    steps' in ``costs``)."""

    def __init__(self, costs: StepCosts):
        self.costs = costs
        self.since_plain: dict[int, int] = {}  # batch size -> verification steps since a plain
        self.window: dict[int, list] = {}  # batch size -> [verifications, steps, tokens,
        # seconds] so far
        self.gain: float | None = None  # the last window's (tokens/s while on) / (plain)
        self.paused: dict[int, int] = {}  # batch size -> its plain steps left before
        # speculation is tried again there
        self.pause: dict[int, int] = {}  # batch size -> its next pause's length
        self.consulted = False  # the step being taken was offered to speculation (not paused)
        self.trend: dict[int, float] = {}  # batch size -> the moving average of the log of
        # its windows' gains, those judged on verifications (``_JUDGED``)

    def allow(self, n: int, through_pause: bool = False) -> bool:
        """Whether a step at batch size ``n`` may verify drafts: not paused there (unless
        ``through_pause``: the step then counts in the pause, not in a window), a plain
        figure measured, and no refresh of it due."""
        self.consulted = False
        if self.paused.get(n):
            self.paused[n] -= 1
            if not through_pause:
                return False
        else:
            self.consulted = True
        return n in self.costs.plain and self.since_plain.get(n, 0) < _REFRESH

    def longest_pause(self, n: int) -> int:
        """Plain steps at batch size ``n`` in ``_PAUSE_MAX_SECONDS`` (at least ``_PAUSE``)."""
        plain = self.costs.plain.get(n)
        return max(_PAUSE, int(_PAUSE_MAX_SECONDS / plain)) if plain else _PAUSE

    def plain_step(self, n: int, steady: bool = True, seconds: float = 0.0) -> None:
        """A plain step at batch size ``n`` (its ``seconds``, with the drafting before it);
        ``steady``: its seconds were measured (it followed a plain step at ``n``): a fresh
        figure, so verification may go on for ``_REFRESH`` steps (a refresh is two plain
        steps: the first one pays for the change of shape). A step taken while speculation
        was on counts in the window (``n`` tokens)."""
        if steady:
            self.since_plain[n] = 0
        if self.consulted and seconds > 0:
            self._weigh(n, 0, n, seconds)
        self.consulted = False

    def verify_step(self, n: int, seconds: float, tokens: int) -> None:
        self.since_plain[n] = self.since_plain.get(n, 0) + 1
        self.consulted = False
        if seconds > 0:
            self._weigh(n, 1, tokens, seconds)

    def _weigh(self, n: int, verified: int, tokens: int, seconds: float) -> None:
        plain = self.costs.plain.get(n)
        if not plain:  # (None, or a clock too coarse to time a step)
            return
        w = self.window.setdefault(n, [0, 0, 0, 0.0])
        w[0] += verified
        w[1] += 1
        w[2] += tokens
        w[3] += seconds
        if w[0] < _WINDOW and w[1] < _WINDOW_STEPS:
            return
        self.gain = (w[2] / w[3]) / (n / plain)
        self.window[n] = [0, 0, 0, 0.0]  # (``w`` is the window just weighed)
        if w[0] >= _JUDGED:  # verifications enough to say whether they pay here: the
            # trend of such windows' gains decides (one window's is noisy: on the default
            # trained model at batch 1, where speculation makes 1.2-1.3x, a third of the
            # windows lost, each pausing it; at batch 8, where it loses, one in six won)
            t = self.trend.get(n)
            g = math.log(self.gain)
            self.trend[n] = t = g if t is None else _TREND * t + (1 - _TREND) * g
            losing = t < math.log(_WORTH)
        else:  # lookups (and few verifications): they pause it unless verifications have
            # been gaining here (then the lookups' cost is the price of the next drafts); a
            # batch size where the weighing refuses nearly every draft is never judged, and
            # its lookups pause it too
            t = self.trend.get(n)
            losing = (t is None or t < math.log(_WORTH)) and self.gain < _WORTH
        if losing:
            self.paused[n] = self.pause.get(n, _PAUSE)
            self.pause[n] = min(2 * self.paused[n], self.longest_pause(n))
        elif w[0] >= _JUDGED:  # (a window of lookups alone never shortens the next pause)
            self.pause[n] = max(_PAUSE, self.pause.get(n, _PAUSE) // 2)


class Speculator:
    """The engine's drafts: ``drafts(active)`` before a step (None: take a plain step),
    ``record`` after a verification."""

    def __init__(self, k_max: int, max_seq_len: int, costs: StepCosts | None = None):
        self.k_max, self.max_seq_len = k_max, max_seq_len
        self.costs = costs if costs is not None else StepCosts()
        self.backoff = Backoff(self.costs)
        self.drafted = self.accepted = 0  # totals (metrics)
        self._by_n = MatchRates(_PRIOR_DECAY, _ENGINE_FADE)  # the engine's acceptance of
        # drafts per matched n-gram length, over all sequences
        self._idle: dict[int, int] = {}  # batch size -> weighings in a row where nothing paid
        self._rest: dict[int, int] = {}  # batch size -> steps left before the next weighing

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Sequences that may draft: generating (not feeding a prompt tail), no attention
        diagnostics (their rows come from the diagnostics graph, one token a step)."""
        return not seq.forced and not seq.wants_attention

    def admit(self, seq: Sequence) -> None:
        # a constrained row drafts the tokens its grammar forces instead (server.fast_forward)
        if self.eligible(seq) and seq.req.constraint is None:
            look = seq.req.lookup_ids
            seq.drafting = Drafting(AdaptiveK(self.k_max), source=[
                *look, *seq.req.prompt_ids] if look else seq.req.prompt_ids)

    def drafts(self, active: list[Sequence]) -> list[list[int]] | None:
        """Each row's draft ([] for none), or None when no row drafts or speculation is paused
        (the plain step is cheaper then)."""
        self.backoff.consulted = False
        # a row with attention diagnostics (or feeding its prompt's tail for them) needs the
        # diagnostics graph's step: the whole batch takes it
        if any(s.drafting is None for s in active) and \
                any(s.wants_attention or s.forced for s in active):
            return None
        n = len(active)
        # paused at this batch size: only a request's own draft source (a prediction) drafts
        only = bool(self.backoff.paused.get(n)) and [
            s.drafting is not None and bool(s.req.lookup_ids) for s in active]
        if not self.backoff.allow(n, through_pause=bool(only) and any(only)):
            return None
        if self._rest.get(n, 0):  # no draft paid at this batch size lately: weighed less often
            self._rest[n] -= 1
            return None
        out = [self._propose(seq) for seq in active] if not only else [
            self._propose(seq) if mine else [] for seq, mine in zip(active, only)]
        if not any(out):
            return None
        rows = [(self.rate(s) if d else 0.0, len(d)) for s, d in zip(active, out)]
        S = best_positions(rows, self.costs.relatives(n, 1 + max(len(d) for d in out)))
        if S == 1:  # no draft pays for its positions at this batch size now: the rows'
            for seq, d in zip(active, out):  # acceptance estimates fade towards the prior,
                if d:  # so that in a while they are weighed (and then measured) again
                    seq.drafting.k.fade()
                    self._by_n.fade(seq.drafting.n)  # (the engine's figure, slowly)
            # and the next steps at this batch size skip the weighing (lookups, the choice:
            # ~10% of a plain step at batch 8 on a small model): 1, 3, then 7 steps
            self._idle[n] = streak = min(self._idle.get(n, 0) + 1, _MAX_REST_LOG2)
            self._rest[n] = (1 << streak) - 1
            return None
        self._idle[n] = 0
        return [d[:S - 1] for d in out]

    def _propose(self, seq: Sequence) -> list[int]:
        """The longest draft ``seq`` offers this step ([]: none)."""
        d = seq.drafting
        if d is None:
            return []
        if d.skip:  # its last lookups found nothing: it looks again less often
            d.skip -= 1
            return []
        gen = seq.generated
        if d.index is None:  # (not at admission: a 1,000-token prompt's index takes ~1-2 ms,
            # which would come before the first token; a request of one token needs none)
            d.index = NgramIndex()
        prompt = d.source
        if len(d.index) < len(prompt):  # a long prompt is indexed over several steps, so
            # that no step of the batch stalls for it; it drafts once the index is whole
            d.index.extend(prompt[len(d.index):len(d.index) + _INDEX_CHUNK])
            if len(d.index) < len(prompt):
                return []
        if d.indexed < len(gen):  # tokens chosen since the last look
            d.index.extend(gen[d.indexed:])
            d.indexed = len(gen)
        # room: the draft's tokens and the one after them are new tokens of the sequence
        room = min(seq.req.stopping.max_new_tokens - len(gen),
                   self.max_seq_len - len(seq.req.prompt_ids) - len(gen)) - 1
        k = d.k.k(room)
        draft = d.index.propose(k) if k > 0 else []
        d.n = d.index.matched
        d.from_prediction = max(0, len(seq.req.lookup_ids) - d.index.start) if draft else 0
        if k > 0 and not draft:
            d.empty += 1
            d.skip = min(1 << d.empty, _MAX_SKIP) - 1
        elif draft:
            d.empty = 0
        return draft

    def match_rate(self, n: int) -> float:
        """The engine's per-token acceptance of drafts that followed an n-token match (the
        prior of a sequence's own estimate). Optimistic (``_UNTRIED``) while few such drafts
        were verified, so that each match length is tried and measured: from a pessimistic
        start (the engine's acceptance over all drafts, most of them short matches' echoes)
        the loops' drafts were never verified where a verification costs ~2 plain steps."""
        return self._by_n.rate(n, _UNTRIED)

    def rate(self, seq: Sequence) -> float:
        """The acceptance ``seq``'s current draft is weighed with: its own for the draft's
        matched length, drawn towards the engine's."""
        d = seq.drafting
        return d.k.rate(d.n, self.match_rate(d.n))

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        if seq.drafting is not None and drafted:
            n = seq.drafting.n
            seq.drafting.k.update(n, drafted, accepted)
            self._by_n.update(n, drafted, accepted)
            p = seq.drafting.from_prediction  # (OpenAI's usage of a prediction: its
            if p:  # tokens among the draft's, which may run on into the prompt)
                seq.prediction_accepted += min(accepted, p)
                seq.prediction_rejected += min(drafted, p) - min(accepted, p)
        self.drafted += drafted
        self.accepted += accepted

"""What the engine's steps cost by shape, measured as they run: the seconds of a plain decode
step at each batch size, and of each extra position a verification step feeds per row
(``FusedLM.verify`` pads every row to the longest). A step is the model call and the handling
of its tokens after it (a verification walks its rows token by token: at batch 8 on a small
model that is a good part of the step). The speculator and the forced-token
fast-forward choose their draft lengths from these figures; both see the same ones.

The cost of a call of S positions a row at batch size n is modelled as
``plain(n) + per_position(n) * n * (S - 1)``: on the CPU provider, 2 cores, the default trained
model at batch 1 measured 1.09, 1.13, 1.25, 1.38, 1.51, 1.78, 1.95 x a plain step for S = 2, 3,
4, 5, 6, 8, 9 (close to linear past the first extra position); 100M at batch 8, 2.8x at S = 5
and ~9x at S = 17.
"""
from __future__ import annotations

import statistics
from collections import deque

_EMA = 0.2  # weight of the newest plain step's seconds
_SAMPLES = 9  # an extra position's cost: the median of this many recent verifications (one
# call slowed by another process moves a median little; it moves an average a lot)
# before a batch size's verification is measured: an extra position a row costs this fraction
# of a plain step per row (optimistic, so that the first verification measures it)
PRIOR_PER_POSITION = 0.05


class StepCosts:
    """Exponential averages of step seconds per batch size (``plain_step``, ``verify_step``
    after each call) and the relative cost of a shape (``relative``)."""

    def __init__(self):
        self.plain: dict[int, float] = {}  # batch size -> EMA seconds of a plain step
        self.per_position: dict[int, float] = {}  # batch size -> seconds of a padded
        # position beyond the first of each row, in a verification call (the median of ...)
        self._samples: dict[int, deque] = {}  # ... batch size -> the recent figures

    def plain_step(self, n: int, seconds: float) -> None:
        old = self.plain.get(n)
        self.plain[n] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def verify_step(self, n: int, positions: int, seconds: float) -> None:
        """A verification call at batch size ``n`` with ``positions`` per row (padded) took
        ``seconds``: the cost of the positions past the first."""
        plain = self.plain.get(n)
        if plain is None or positions < 2:
            return
        x = max(0.0, seconds - plain) / (n * (positions - 1))
        recent = self._samples.setdefault(n, deque(maxlen=_SAMPLES))
        recent.append(x)
        self.per_position[n] = statistics.median(recent)

    def forget(self, n: int, factor: float) -> None:
        """Scale batch size ``n``'s extra-position figures by ``factor`` (< 1: a drafter that
        refuses for the cost lowers it, so that it tries, and measures, again later)."""
        recent = self._samples.get(n)
        if recent:
            self._samples[n] = deque((x * factor for x in recent), maxlen=_SAMPLES)
            self.per_position[n] = statistics.median(self._samples[n])

    def relative(self, n: int, positions: int) -> float:
        """Seconds of a call of ``positions`` per row at batch size ``n`` over a plain step's
        (the prior where not measured yet)."""
        plain, per = self.plain.get(n), self.per_position.get(n)
        if plain is None or plain <= 0 or per is None:
            return 1.0 + PRIOR_PER_POSITION * (positions - 1)
        return 1.0 + per * n * (positions - 1) / plain

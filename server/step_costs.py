"""What the engine's steps cost by shape, measured as they run: the seconds of a plain decode
step at each batch size, and what a verification step of S positions a row costs relative to
it (``FusedLM.verify`` pads every row to the longest). A step is the model call and the
handling of its tokens after it (a verification walks its rows token by token: at batch 8 on
a small model that is a good part of the step). The speculator and the forced-token
fast-forward choose their draft lengths from these figures; both see the same ones.

Each shape (batch size n, positions S) keeps its own figure: the median of its recent
calls' seconds over the plain step's. One slope per batch size (``plain + per_position * n *
(S - 1)``) was tried first and misled: the step from one position to two costs far more than
each one after it (the 6M model at batch 8 on the CPU provider, 2 cores: a plain step 612 us,
S = 2, 3, 4, 5 1,173, 1,606, 1,927, 2,247 us), so a slope fitted on the longer calls priced
S = 2 at ~1.5x where it cost ~1.9x (2.3x with its tokens' handling), and the engine took
verification steps that lost speed. A shape not measured yet is priced by interpolation
between the measured ones (S = 1 is 1.0), beyond the longest one along the last segment's
slope, and with nothing measured at that batch size by an optimistic prior, so that it is
tried, and measured, once.
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque

_SAMPLES = 9  # a shape's figure, and a plain step's: the median of this many recent calls (one
# call slowed by another process moves a median little; it moves an average a lot: over one
# run of the default trained model at batch 8 then 1, an average of the plain steps (weight
# 0.2 for the newest) ranged 3.5-4.7 ms at batch 8 and 1.3-2.5 ms at batch 1, where the steps'
# median was 4.0 and 1.4 ms; each verification's ratio is taken against that figure)
# before a batch size's verification is measured: an extra position costs this fraction of a
# plain step (optimistic, so that the first verification measures it)
PRIOR_PER_POSITION = 0.05


class StepCosts:
    """Plain-step seconds per batch size (``plain_step``), verification calls' seconds per
    shape (``verify_step``), and the relative cost of a shape (``relative``)."""

    def __init__(self):
        self.plain: dict[int, float] = {}  # batch size -> seconds of a plain step (median)
        self._plain_samples: dict[int, deque] = {}  # batch size -> recent steady seconds
        self._samples: dict[int, dict[int, deque]] = {}  # n -> S -> recent seconds / plain
        self.ratio: dict[int, dict[int, float]] = {}  # n -> S -> their median
        self._last: tuple[int, int] | None = None  # the last step's (n, S)

    def plain_step(self, n: int, seconds: float, once: bool = False) -> bool:
        """A plain step at batch size ``n`` took ``seconds``. Counted only when the step
        before it was a plain one at the same batch size (returns whether it was): the first
        plain call after a verification, or at a new batch size, pays for the change of shape
        (~15% more on the CPU provider, measured with onnxruntime alone at batch 8), and a
        reference measured only there made every verification look cheaper than it is.
        ``once``: the call paid a one-time cost (it built its IO binding): not counted."""
        steady = self._last in (None, (n, 1))
        self._last = (n, 1)
        if steady and not once:
            recent = self._plain_samples.setdefault(n, deque(maxlen=_SAMPLES))
            recent.append(seconds)
            self.plain[n] = statistics.median(recent)
        return steady

    def verify_step(self, n: int, positions: int, seconds: float, once: bool = False) -> None:
        """A verification call at batch size ``n`` with ``positions`` per row (padded) took
        ``seconds`` (measured against the plain step's seconds at the time). ``once``: the
        call paid a one-time cost, not counted: the first call of a shape builds its IO
        binding and is onnxruntime's first run of that shape. On the trained model at batch 1
        such first calls measured 2.5-3.4 plain steps for S = 2, 3, 5 and 7, where S = 4's
        later calls took 1.31 (median of 295); a shape taken once kept that figure, and the
        drafts that would have used it were refused for its price."""
        self._last = (n, positions)
        plain = self.plain.get(n)
        if plain is None or plain <= 0 or positions < 2 or once:
            return
        recent = self._samples.setdefault(n, {}).setdefault(positions, deque(maxlen=_SAMPLES))
        recent.append(max(1.0, seconds / plain))
        self.ratio.setdefault(n, {})[positions] = statistics.median(recent)

    def measured(self, n: int) -> bool:
        """Whether a plain step and a verification were measured at batch size ``n``."""
        return n in self.plain and bool(self.ratio.get(n))

    def forget(self, n: int, factor: float) -> None:
        """Scale what batch size ``n``'s verifications cost beyond a plain step by ``factor``
        (< 1: a drafter that refuses for the cost lowers it, so that it tries, and measures,
        again later)."""
        for S, recent in self._samples.get(n, {}).items():
            scaled = deque((1 + (r - 1) * factor for r in recent), maxlen=_SAMPLES)
            self._samples[n][S] = scaled
            self.ratio[n][S] = statistics.median(scaled)

    def relative(self, n: int, positions: int) -> float:
        """Seconds of a call of ``positions`` per row at batch size ``n`` over a plain step's:
        measured, else interpolated (see the module's docstring)."""
        if positions <= 1:
            return 1.0
        known = self.ratio.get(n)
        if known and n in self.plain and positions in known:  # (measured: no list)
            return known[positions]
        return self.relatives(n, positions)[-1]

    def relatives(self, n: int, top: int) -> list[float]:
        """``relative(n, S)`` for S = 1 .. ``top``, in one pass (the drafters weigh every
        length before each step)."""
        known = self.ratio.get(n)
        if not known or n not in self.plain:
            return [1.0 + PRIOR_PER_POSITION * (S - 1) for S in range(1, top + 1)]
        xs = sorted(known)
        ys = [known[S] for S in xs]
        xs.insert(0, 1)
        ys.insert(0, 1.0)
        out = [1.0]
        for S in range(2, top + 1):
            r = known.get(S)
            if r is None:
                i = bisect.bisect_left(xs, S)  # xs[i - 1] < S < xs[i] (or the end)
                if i == len(xs):  # past the longest measured: along the last segment
                    i -= 1
                x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                r = max(1.0, y0 + max(0.0, (y1 - y0) / (x1 - x0)) * (S - x0))
            out.append(r)
        return out

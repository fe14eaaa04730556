"""What the engine's steps cost by shape, measured as they run: the seconds of a plain decode
step at each batch size, and what a verification step of S positions a row costs relative to
it (``FusedLM.verify`` pads every row to the longest). A step is the model call and the
handling of its tokens after it (a verification walks its rows token by token: at batch 8 on
a small model that is a good part of the step). The speculator and the forced-token
fast-forward choose their draft lengths from these figures; both see the same ones.

Each shape (batch size n, positions S) keeps its recent calls' seconds over the plain
step's (their median: one call slowed by another process moves it little), and a batch size's
shapes are priced together by one line with a jump: ``relative(n, S) = j + b * (S - 2)`` for
S >= 2 (1.0 at S = 1), fitted to the measured shapes' medians by least squares, each weighed
by its count of calls. The step from one position to two costs more than each one after it
(the 6M model at batch 8 on the CPU provider, 2 cores: a plain step 612 us, S = 2, 3, 4, 5
1,173, 1,606, 1,927, 2,247 us), so a slope from S = 1 priced S = 2 at ~1.5x where it cost
~1.9x; the jump's line prices both. Each shape priced by its own median alone (before
2026-12-05) let one early call stick: a short shape measured once or twice while the process
was still warming (the default trained model at batch 1: S = 2 at 2.0-2.4x, where its calls
cost 1.1-1.4x when measured in a row) was refused for that price ever after, so it was never
measured again, and the drafts went to the long shapes or to none (1,240 drafted tokens over
16 x 128 where 1,980 were drafted before). Every shape's calls now move the one line. With
one shape measured the line runs through it from (1, 1.0); with nothing measured at that
batch size an optimistic prior prices every shape, so that it is tried, and measured, once.
"""
from __future__ import annotations

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
        self._lists: dict[int, list[float]] = {}  # n -> its prices, S = 1 .. (relatives)
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
        self._lists.pop(n, None)

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
        self._lists.pop(n, None)

    def relative(self, n: int, positions: int) -> float:
        """Seconds of a call of ``positions`` per row at batch size ``n`` over a plain step's
        (see the module's docstring)."""
        if positions <= 1:
            return 1.0
        return self.relatives(n, positions)[-1]

    def relatives(self, n: int, top: int) -> list[float]:
        """``relative(n, S)`` for S = 1 .. ``top``, in one pass (the drafters weigh every
        length before each step: the list is kept until the line changes). Below the
        shortest measured shape the price is never under the straight line from one plain
        step (S = 1) to that shape's price: a line fitted on longer shapes alone may run
        under 1.0 there, which priced a shape never measured as free."""
        out = self._lists.get(n)
        if out is None or len(out) < top:
            j, b, s0 = self._line(n)
            out = [1.0] + [max(1.0, j + b * (S - 2)) for S in range(2, top + 1)]
            if s0 is not None:
                r0 = max(1.0, j + b * (s0 - 2))
                for S in range(2, min(s0, top + 1)):
                    out[S - 1] = max(out[S - 1], 1.0 + (r0 - 1.0) * (S - 1) / (s0 - 1))
            if self.measured(n):  # (the prior's is not kept: a plain figure may come)
                self._lists[n] = out
        return out[:top]

    def _line(self, n: int) -> tuple[float, float, int | None]:
        """(j, b, s0): batch size ``n``'s price of S = 2 and of each position after it, and its
        shortest measured shape where that is over 2 (``relatives`` keeps what it prices)."""
        if not self.measured(n):
            return 1.0 + PRIOR_PER_POSITION, PRIOR_PER_POSITION, None
        known = self.ratio[n]
        samples = self._samples[n]
        if len(known) == 1:  # through (1, 1.0) and the one shape
            (S0, r0), = known.items()
            b = (r0 - 1.0) / (S0 - 1)
            j = 1.0 + b
        else:  # weighted least squares of r = j + b * (S - 2), a shape weighed by its calls
            sw = swx = swy = swxx = swxy = 0.0
            for S, r in known.items():
                w, x = len(samples[S]), S - 2
                sw += w
                swx += w * x
                swy += w * r
                swxx += w * x * x
                swxy += w * x * r
            sxx = swxx - swx * swx / sw
            b = max(0.0, (swxy - swx * swy / sw) / sxx)  # (noise may tilt it down: then
            j = swy / sw - b * swx / sw  # flat at the mean)
        shortest = min(known)
        return j, b, (shortest if shortest > 2 else None)

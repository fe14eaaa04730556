"""N-gram prompt lookup: draft tokens for speculative decoding from the sequence's own tokens
(prompt + generated), without a draft model (vLLM's ``ngram`` proposer, llama.cpp's lookup
decoding).

For n from ``max_n`` down to ``min_n``: find the most recent *earlier* occurrence of the
sequence's last n tokens, and propose up to ``k`` tokens that followed it. The first n that
matches wins (the longest match). When the continuation runs into the end of the sequence
(a loop whose period is shorter than ``k``: ``_get_get_get``), the copy goes on through the
tokens it has just proposed, so a loop of period p still gets a k-token draft (vLLM stops at
the sequence's end).

``NgramIndex`` keeps, per length looked up, a dict n-gram key -> the position just after its
most recent earlier occurrence, updated as tokens are appended (one dict write per length and
token), so a proposal is at most one dict lookup per length plus the k-token copy, whatever
the context length: no rescan. An n-gram's key is an int, a polynomial hash of its tokens mod 2^64
built from its last token backwards (key(t[e-n:e]) = key(t[e-n+1:e]) * M ^ t[e-n]), so the keys
of the n-grams ending at a position come one from the other, one multiply-xor per n, and a
prompt's keys are computed per n in numpy: a 1,000-token prompt's index took 0.58 ms where
hashing each n-gram's tuple took 0.88 ms (best of 15 interleaved rounds; a step's new token
1.62 vs 1.74 us, 8 lengths). Int keys also free quickly: a 700-token sequence's index with
tuple keys took 218 us to free (thousands of tuples, each untracked by the garbage collector),
52 us with int keys, and that happened in the next request's admission, before its first
token. Two n-grams whose keys collide can only give a wrong draft, which verification rejects:
never a wrong token.

Drafts only decide how much work a verification call can save: a wrong draft costs a rejected
row, never a wrong token (``kvserve.server.spec_verify``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np


LENGTHS = (1, 2, 3, 8)  # the n-gram lengths looked up, longest first. The matched length
# says how far a draft can be trusted: on the default trained model's greedy continuations of
# 16 held-out files, a draft's first token was right 39% of the time after a 1-token match,
# 53% after 2, 63-67% after 3 to 7 and 95% after 8 (a loop), so the speculator estimates
# acceptance per matched length (``AdaptiveK``): 8 separates loops from echoes, and 4 to 7
# drafted no better than 3. Replayed (``bench/spec_replay``, onnxruntime's costs at batch 1,
# the engine's, onnxruntime's at batch 8): 1.714x / 1.629x / 1.186x with these four lengths,
# 1.708x / 1.616x / 1.184x with all of 1 .. 8, which index twice the n-grams per token (a
# dict write each: 12 us a token for 8 lengths in the live engine at batch 8, where the dicts
# are cold after each model call). 1 is the last resort: a single-token match is often wrong,
# but a short draft costs little where a step is cheap, and the draft length follows its
# acceptance; replayed at batch 1, a shortest length of 1 made 2.21 tokens a step against
# 1.96 for 2
MAX_K = 16  # an upper bound on a draft's length (every numeric field has one)
_MUL = 0x9E3779B97F4A7C15  # the keys' multiplier (odd: a bijection mod 2^64)
_MASK = (1 << 64) - 1
_MUL_U64 = np.uint64(_MUL)  # (numpy's uint64 products wrap mod 2^64: the same keys)
_FEW = 16  # up to this many new tokens are indexed one by one (a step's: ~3x faster than the
# slices' zip, which pays its setup per n)


class NgramIndex:
    """The n-gram index of one sequence: ``extend`` it with the prompt, ``append`` each
    accepted token, and ask ``propose(k)`` before a step."""

    def __init__(self, tokens: Iterable[int] = (), lengths: Iterable[int] = LENGTHS):
        self.lengths = tuple(sorted(set(lengths)))
        if not self.lengths or self.lengths[0] < 1 or self.lengths[-1] > 64:
            raise ValueError(f"n-gram lengths must be in [1, 64], got {self.lengths}")
        self.tokens: list[int] = []
        self.matched = 0  # the n-gram length the last proposal matched (0: none)
        self.start = 0  # where in ``tokens`` the last proposal's draft was copied from
        # n -> (for each length looked up) an n-gram's key -> end (exclusive) of its most
        # recent occurrence that has a following token, i.e. an occurrence ending before
        # len(tokens); None for the lengths between them
        self._top = self.lengths[-1]
        self._table: list[dict[int, int] | None] = [None] * (self._top + 1)
        for n in self.lengths:
            self._table[n] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        """One more token of the sequence: the n-grams ending just before it now have a
        follower, so they become proposable."""
        self.extend((token,))

    def extend(self, tokens: Iterable[int]) -> None:
        """More tokens of the sequence. A step's few tokens: per token, the keys of the
        n-grams ending before it, one multiply-xor per n up to the longest length and one
        dict write per length. More (a prompt): per n, the keys of all its n-grams at once in
        numpy and one ``dict.update`` per length (the speculator builds it at the first
        lookup, after the request's first token, 1,024 prompt tokens a step)."""
        t = self.tokens
        old = len(t)
        t.extend(map(int, tokens))
        L = len(t)
        tables, top = self._table, self._top
        if L - old <= _FEW:
            for e in range(old, L):  # the n-grams that end at e gained a follower
                h, j = 0, e
                for n in range(1, min(top, e) + 1):
                    j -= 1
                    h = (h * _MUL ^ t[j]) & _MASK  # the key of t[e - n:e]
                    table = tables[n]
                    if table is not None:
                        table[h] = e
            return
        e0 = max(old, 1)  # the n-grams that end at e0 .. L-1 gained a follower
        if e0 >= L:
            return
        arr = np.asarray(t, np.uint64)
        start = e0  # h: the keys of the (n - 1)-grams ending at start .. L-1
        h = np.zeros(L - e0, np.uint64)
        for n in range(1, min(top, L) + 1):
            a = max(e0, n)  # (an n-gram ends at n at the earliest)
            h = h[a - start:] * _MUL_U64 ^ arr[a - n:L - n]
            start = a
            table = tables[n]
            if table is not None:  # (the most recent occurrence wins: later keys overwrite)
                table.update(zip(h.tolist(), range(a, L)))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens (fewer or none when nothing matches); ``matched`` says
        the length of the n-gram they follow."""
        self.matched = 0
        if k <= 0:
            return []
        k = min(k, MAX_K)
        t = self.tokens
        L = len(t)
        keys, h = [0], 0  # keys[n]: the key of the sequence's last n tokens
        for j in range(L - 1, max(L - self._top, 0) - 1, -1):
            h = (h * _MUL ^ t[j]) & _MASK
            keys.append(h)
        for n in reversed(self.lengths):
            if n >= len(keys):
                continue
            e = self._table[n].get(keys[n])
            if e is None:
                continue
            draft = t[e:e + k]  # up to the sequence's end ...
            shift = L - e
            while len(draft) < k:  # ... then the copy continues through the draft itself
                draft.append(draft[len(draft) - shift])
            self.matched, self.start = n, e
            return draft
        return []


def propose(tokens: list[int], k: int, lengths: Iterable[int] = LENGTHS) -> list[int]:
    """The same proposal without an index (a scan: tests and one-off use)."""
    L = len(tokens)
    for n in sorted(set(lengths), reverse=True):
        if L < n + 1 or k <= 0:
            continue
        tail = tokens[L - n:]
        for e in range(L - 1, n - 1, -1):  # end (exclusive) of an earlier occurrence
            if tokens[e - n:e] == tail:
                draft = tokens[e:e + k]
                while len(draft) < min(k, MAX_K):
                    draft.append(draft[len(draft) - (L - e)])
                return draft[:min(k, MAX_K)]
    return []


class AdaptiveK:
    """A sequence's acceptance estimates, from which its draft length is chosen
    (``server.speculation`` weighs every row of a batch together: ``best_positions``).

    Acceptance is modelled per draft token and per matched n-gram length n (``NgramIndex.
    matched``: a draft that follows an 8-token match is a loop's, one after a 1-token match an
    echo): ``rate(n, prior)`` is the probability that a draft token is accepted when the ones
    before it were (of m accepted out of K, m successes and one failure unless m == K, older
    verifications decayed), so a draft of K tokens is expected to yield ``expected(rate, K)``
    = 1 + a + ... + a^K tokens. ``prior`` is what the engine measured for that n over all its
    sequences (``server.speculation``), worth ``PRIOR_TRIALS`` verifications: a new sequence
    starts from what this model's drafts have earned, and its own verifications take over (a
    sequence sampled at a high temperature has its drafts accepted less often than the
    engine's greedy ones). While its drafts are not used (they would not pay for their cost)
    its own figures fade (``fade``), back towards the prior, so that drafting resumes when the
    text may have changed."""

    def __init__(self, k_max: int):
        if not 0 <= k_max <= MAX_K:
            raise ValueError(f"speculative tokens must be in [0, {MAX_K}], got {k_max}")
        self.k_max = k_max
        self._rates = MatchRates(_DECAY, _IDLE_DECAY)

    def rate(self, n: int, prior: float) -> float:
        """The estimated acceptance of a draft token after an n-token match whose
        predecessors were accepted."""
        return self._rates.rate(n, prior)

    def k(self, cap: int | None = None) -> int:
        """The longest draft this sequence offers (``cap``: the room left)."""
        return max(0, self.k_max if cap is None else min(self.k_max, cap))

    def update(self, n: int, drafted: int, accepted: int) -> None:
        """After a verification: ``accepted`` of ``drafted`` draft tokens (that followed an
        n-token match) were kept."""
        self._rates.update(n, drafted, accepted)

    def fade(self) -> None:
        """A step where its draft was not used: its own figures weigh a little less against
        the prior."""
        self._rates.fade()


class MatchRates:
    """Acceptance per matched n-gram length from decayed counts: per n, the accepted draft
    tokens and the trials (of m accepted out of K, m successes and one failure unless m == K),
    each update weighing the earlier ones by ``decay``, each ``fade`` by ``idle_decay``;
    ``rate(n, prior)`` draws them towards ``prior``, worth ``PRIOR_TRIALS`` trials. A
    sequence's (``AdaptiveK``) and the engine's over all sequences (``server.speculation``)."""

    def __init__(self, decay: float, idle_decay: float):
        self.decay, self.idle_decay = decay, idle_decay
        self._counts: dict[int, list[float]] = {}  # n -> [hits, trials]

    def rate(self, n: int, prior: float) -> float:
        h, t = self._counts.get(n, (0.0, 0.0))
        return (h + PRIOR_TRIALS * prior) / (t + PRIOR_TRIALS)

    def update(self, n: int, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        c = self._counts.setdefault(n, [0.0, 0.0])
        c[0] = self.decay * c[0] + accepted
        c[1] = self.decay * c[1] + accepted + (accepted < drafted)

    def fade(self, n: int | None = None) -> None:
        """Every length's counts (``n``: that one's, if any) weigh less against the prior."""
        for m, c in self._counts.items():
            if n is None or m == n:
                c[0] *= self.idle_decay
                c[1] *= self.idle_decay


PRIOR_TRIALS = 2.0  # what a prior weighs against the counts of a match length, in trials
_DECAY = 0.8  # weight of the earlier verifications in the acceptance estimate, per update
_IDLE_DECAY = 0.9  # ... and per step whose draft was not used


def expected(a: float, k: int) -> list[float]:
    """[E(0), .., E(k)]: the tokens a draft of j tokens is expected to yield, 1 + a + .. + a^j.
    (``best_positions`` sums the same series in its own loop, without the list per row: built
    through this, its weighing took 29 us instead of 18 at batch 8; tests weigh batches with
    this to check it.)"""
    out, e, p = [1.0], 1.0, 1.0
    for _ in range(k):
        p *= a
        e += p
        out.append(e)
    return out


def best_positions(rows: list[tuple[float, int]], cost) -> int:
    """The positions S a row (1 + the longest draft used) for a batch whose rows offer drafts
    of ``len`` tokens with acceptance ``a`` (``rows``: (a, len) each; a row without a draft:
    len 0), a call of S positions a row costing ``cost(S)`` plain steps (or ``cost[S - 1]``: a
    sequence of them, S = 1 ..), every row using up to S - 1 of its tokens (the padding is
    paid anyway). S = 1 is the plain step. Ties: the shorter.

    The S whose rows gain most in geometric mean: each row's speed is its expected tokens
    E_row(S) = 1 + a + .. + a^min(S - 1, len) per cost(S), against 1 per plain step, and the
    step maximises the sum over rows of log(E_row(S) / cost(S)). At batch 1 that is the most
    tokens per cost. In a batch, a row without a good draft runs at 1 / cost(S) of its plain
    speed while the others verify: the sum of the rows' tokens would slow it for the others'
    sake whenever they gain more in all, where this asks them to gain more than it loses, in
    ratio. Replayed on the default trained model's continuations of 16 held-out files at
    onnxruntime's own call costs (``bench/spec_replay``, the bench's closed batches of 8:
    each waits for its slowest row), batch 8 made 1.205x the plain steps' speed against
    1.170x for the sum of tokens; batch 1 the same. (It runs before every step that may
    draft: one pass per row.)"""
    top = 0
    for _, k in rows:
        if k > top:
            top = k
    if top == 0:
        return 1
    if callable(cost):
        cost = [cost(S) for S in range(1, top + 2)]
    # gains[j]: the sum over rows of log E_row(j + 1) (a row: 1 + a + .. + a^min(j, k))
    gains = [0.0] * (top + 1)
    for a, k in rows:
        e = p = 1.0
        g = 0.0
        for j in range(1, top + 1):
            if j <= k:  # (a shorter draft: its tokens stop growing)
                p *= a
                e += p
                g = math.log(e)
            gains[j] += g
    n = len(rows)
    best, best_s = 0.0, 1  # (S = 1: every row at its plain speed, log 1 = 0)
    for s in range(2, top + 2):
        v = gains[s - 1] - n * math.log(cost[s - 1])
        if v > best + 1e-9 * n:
            best, best_s = v, s
    return best_s

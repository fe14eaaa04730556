"""Score: per-token log-probabilities of given sequences (prompt scoring), one model call at
a time so that generation goes on between calls."""
from __future__ import annotations

from typing import Generator

import numpy as np

from kvserve.model.sampling import top_n

from .domain import ScoredSequence, ScoreRequest

_BLOCK_FLOATS = 1 << 22  # logits per log-softmax call (its output, 16 MB, is held beside them)
_SCORE_GROUP = 512  # tokens per shared prefill: bigger batches fall out of cache


class _Scored:
    """Per-token logprobs of one Score sequence, filled chunk by chunk."""

    def __init__(self, ids: list[int], n_top: int, log_softmax):
        T = len(ids)
        self.ids, self.n_top = ids, n_top
        self.log_softmax = log_softmax  # the runner's, over rows (T, V)
        self.lps = np.zeros(T - 1, np.float32)
        self.tops_i = np.zeros((T - 1, n_top), np.int64) if n_top else None
        self.tops_l = np.zeros((T - 1, n_top), np.float32) if n_top else None

    def record(self, start: int, rows: np.ndarray) -> None:
        """rows (t, V): logits at positions start.. (row j predicts ids[start + j + 1])."""
        t = min(len(rows), len(self.ids) - 1 - start)
        if t <= 0:
            return
        block = max(1, _BLOCK_FLOATS // rows.shape[-1])
        for a in range(0, t, block):
            b = min(a + block, t)
            lp = self.log_softmax(rows[a:b])  # (b - a, V)
            target = np.asarray(self.ids[start + a + 1:start + b + 1], np.int64)
            self.lps[start + a:start + b] = lp[np.arange(b - a), target]
            for j in range(b - a if self.n_top else 0):
                self.tops_i[start + a + j], self.tops_l[start + a + j] = top_n(lp[j],
                                                                               self.n_top)

    def result(self) -> ScoredSequence:
        return ScoredSequence(len(self.ids), np.asarray(self.ids[1:], np.int64), self.lps,
                              self.tops_i, self.tops_l)


def score_steps(lm, req: ScoreRequest, cap: int) -> Generator[None, None, list]:
    """Score ``req`` with the runner ``lm``, one model call per ``next()`` (the engine
    interleaves generation steps); returns the ScoredSequence list (StopIteration.value).

    Sequences short enough share prefills (each sequence in its own slot of a private cache)
    whose logits (B x T x V) stay under ``cap`` tokens' worth; a longer one prefills its first
    ``cap`` tokens, then the next chunks after them. Never more than one chunk of logits held."""
    seqs = req.sequences
    group_cap = min(cap, _SCORE_GROUP)
    acc = [_Scored(ids, req.top_logprobs, lm.log_softmax) for ids in seqs]
    short = sorted((i for i, ids in enumerate(seqs) if len(ids) <= cap),
                   key=lambda i: len(seqs[i]))
    group: list[int] = []
    for i in short + [None]:
        if group and (i is None or (len(group) + 1) * len(seqs[i]) > group_cap):
            _prefill_group(lm, [seqs[j] for j in group], [acc[j] for j in group])
            group = []
            yield
        if i is not None:
            group.append(i)
    for ids, a in zip(seqs, acc):
        T = len(ids)
        if T <= cap:
            continue
        kv = lm.new_cache(1, capacity=T + 1)  # private to this sequence
        # LongRoPE past its limit: every chunk asks for the factors of the whole sequence
        limit = lm.cfg.longrope_limit
        kw = {"rope_length": T} if limit is not None and T > limit else {}
        for start in range(0, T - 1, cap):  # one chunk per loop turn
            chunk = ids[start:min(start + cap, T - 1)]
            if start == 0 and not kw:
                a.record(0, lm.prefill(kv, 0, [ids[:cap]]).logits[0])
            else:
                a.record(start, lm.extend(kv, 0, np.asarray(chunk, np.int64), **kw))  # (t, V)
            yield
    return [a.result() for a in acc]


def _prefill_group(lm, seqs: list[list[int]], acc: list[_Scored]) -> None:
    kv = lm.new_cache(len(seqs), capacity=max(len(ids) for ids in seqs))
    for logits, a in zip(lm.prefill(kv, 0, seqs).logits, acc):  # (T_b, V) each
        a.record(0, logits)

"""Score: per-token log-probabilities of given sequences (prompt scoring), one model call at
a time so that generation goes on between calls.

Sequences of one request that begin alike (a context scored with several continuations: the
choices of a multiple-choice question, a few-shot header) compute their shared first tokens
once, where the engine shares rows at all (``share``: the prefix cache's switch and exactness
rule): the shared tokens are prefilled in a slot of their own, whose rows each member then
takes (a device copy) before its own tokens are fed after them. A shared row's logits are
those of its position in every member (they depend on the tokens before it only), so the
members' log-probabilities there are one log-softmax; after it, the rows are the prefix
cache's (fp32: within ~1e-6 of one prefill of the whole sequence). Across requests, the
prefix cache holds Score's rows with their log-probabilities (``server.score_cache``)."""
from __future__ import annotations

from typing import Generator

import numpy as np

from kvserve.artifact.base import chunks
from kvserve.model.sampling import top_n

from .domain import ScoredSequence, ScoreRequest
from .score_cache import ScorePool
from .slot_rows import common_prefix

_BLOCK_FLOATS = 1 << 22  # logits per log-softmax call (its output, 16 MB, is held beside them)
_SCORE_GROUP = 512  # tokens per shared prefill: bigger batches fall out of cache
_CLUSTER_ROWS = 2048  # KV rows a cluster's private cache holds (or one sequence's)
MIN_SHARED = 16  # first tokens sequences must share to be prefilled as one (the prefix
# cache's block: fewer save less than the call and the copies cost)


class _Scored:
    """Per-token logprobs of one Score sequence, filled chunk by chunk."""

    def __init__(self, ids: list[int], n_top: int, log_softmax):
        T = len(ids)
        self.ids, self.n_top = ids, n_top
        self.log_softmax = log_softmax  # the runner's, over rows (T, V)
        self.lps = np.zeros(T - 1, np.float32)
        self.tops_i = np.zeros((T - 1, n_top), np.int64) if n_top else None
        self.tops_l = np.zeros((T - 1, n_top), np.float32) if n_top else None
        self.cached = 0  # tokens taken from the prefix cache (server.score_cache)

    def record(self, start: int, rows: np.ndarray) -> None:
        """rows (t, V): logits at positions start.. (row j predicts ids[start + j + 1])."""
        record_rows(start, rows, [self])

    def result(self) -> ScoredSequence:
        return ScoredSequence(len(self.ids), np.asarray(self.ids[1:], np.int64), self.lps,
                              self.tops_i, self.tops_l, self.cached)


def record_rows(start: int, rows: np.ndarray, scored: list[_Scored]) -> None:
    """rows (t, V): logits at positions start.. of every sequence of ``scored`` (rows they
    share: their tokens up to start + t - 1 are the same), each row's log-softmax and top
    ids computed once for all of them; row j predicts each sequence's own ids[start + j + 1]
    (the last shared row predicts the first token where they part)."""
    need = max(min(len(rows), len(s.ids) - 1 - start) for s in scored)
    if need <= 0:
        return
    n_top = scored[0].n_top  # (one request's sequences: one top_logprobs)
    block = max(1, _BLOCK_FLOATS // rows.shape[-1])
    for a in range(0, need, block):
        b = min(a + block, need)
        lp = scored[0].log_softmax(rows[a:b])  # (b - a, V)
        tops = [top_n(lp[j], n_top) for j in range(b - a)] if n_top else []
        for s in scored:
            t = min(b, len(s.ids) - 1 - start)  # (a shorter sequence ends inside the block)
            if t <= a:
                continue
            target = np.asarray(s.ids[start + a + 1:start + t + 1], np.int64)
            s.lps[start + a:start + t] = lp[np.arange(t - a), target]
            for j in range(t - a if n_top else 0):
                s.tops_i[start + a + j], s.tops_l[start + a + j] = tops[j]


def shared_clusters(seqs: list, idx: list[int], min_shared: int = MIN_SHARED, base: int = 0
                    ) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """Among the sequences ``idx`` of ``seqs``: clusters of two or more that share their first
    ``length`` >= ``min_shared`` tokens, as [(length, members)], and the sequences in none.

    In token order neighbours share the most; a run of them is one cluster while the tokens it
    saves ((length - ``base``) x (members - 1); ``base``: first tokens they all have already)
    do not shrink by taking the next one in, so that a few-shot header shared by every
    question wins over the choices of one question where that saves more, and not the other
    way round (``_score_cluster`` then clusters the members again, after the header)."""
    order = sorted(idx, key=lambda i: seqs[i])
    clusters: list[tuple[int, list[int]]] = []
    rest: list[int] = []
    run: list[int] = []
    length = 0  # the tokens the run's members share (one alone: all of its own)

    def close() -> None:
        if len(run) > 1:
            clusters.append((length, list(run)))
        else:
            rest.extend(run)

    for i in order:
        if run:
            shared = common_prefix(seqs[run[-1]], seqs[i], length)
            if shared >= min_shared and \
                    (shared - base) * len(run) >= (length - base) * (len(run) - 1):
                run.append(i)
                length = shared
                continue
            close()
        run, length = [i], len(seqs[i])
    if run:
        close()
    return clusters, rest


def score_steps(lm, req: ScoreRequest, cap: int, share: bool = False,
                pool: ScorePool | None = None) -> Generator[None, None, list]:
    """Score ``req`` with the runner ``lm``, one model call per ``next()`` (the engine
    interleaves generation steps); returns the ScoredSequence list (StopIteration.value).

    ``share``: sequences that begin alike compute their shared tokens once (the module's
    docstring). The others, short enough, share prefills (each sequence in its own slot of a
    private cache) whose logits (B x T x V) stay under ``cap`` tokens' worth; a longer one
    prefills its first ``cap`` tokens, then the next chunks after them. Never more than one
    chunk of logits held. ``pool``: the engine's prefix cache, whose rows and
    log-probabilities of earlier Score requests a sequence takes where it begins with them,
    and which keeps each one's (``server.score_cache``)."""
    seqs = req.sequences
    group_cap = min(cap, _SCORE_GROUP)
    top = min(req.top_logprobs, lm.cfg.vocab_size)  # (a longer list than the vocabulary: all)
    acc = [_Scored(ids, top, lm.log_softmax) for ids in seqs]
    clusters, alone = shared_clusters(seqs, list(range(len(seqs)))) if share \
        else ([], list(range(len(seqs))))
    while clusters:  # (a cluster's own clusters next, after its rows are in the pool)
        length, members = clusters.pop(0)
        clusters[:0] = yield from _score_cluster(lm, seqs, length, members, acc, cap, pool)
    short = sorted((i for i in alone if len(seqs[i]) <= cap), key=lambda i: len(seqs[i]))
    group: list[int] = []
    for i in short + [None]:
        if group and (i is None or (len(group) + 1) * len(seqs[i]) > group_cap):
            yield from _prefill_group(lm, [seqs[j] for j in group], [acc[j] for j in group],
                                      pool)
            group = []
        if i is not None:
            group.append(i)
    for i in alone:
        if len(seqs[i]) > cap:
            yield from _score_long(lm, seqs[i], acc[i], cap, pool)
    return [a.result() for a in acc]


def _score_long(lm, ids: list[int], a: _Scored, cap: int, pool: ScorePool | None
                ) -> Generator[None, None, None]:
    """A sequence past ``cap`` tokens: its first ``cap`` tokens (after what the pool gave),
    then the next chunks after them."""
    T = len(ids)
    kv = lm.new_cache(1, capacity=T + 1)  # private to this sequence
    first = pool.take(kv, 0, ids, [a], whole=True) if pool else 0
    if first == T:
        return
    # LongRoPE past its limit: every chunk asks for the factors of the whole sequence
    limit = lm.cfg.longrope_limit
    kw = {"rope_length": T} if limit is not None and T > limit else {}
    for start in range(first, T - 1, cap):  # one chunk per loop turn
        chunk = ids[start:min(start + cap, T - 1)]
        if start == 0 and not kw:
            a.record(0, lm.prefill(kv, 0, [ids[:cap]]).logits[0])
        else:
            a.record(start, lm.extend(kv, 0, np.asarray(chunk, np.int64), **kw))  # (t, V)
        yield
    if pool:
        pool.keep(kv, [(0, ids, a)])


def _score_cluster(lm, seqs: list, length: int, members: list[int], acc: list[_Scored],
                   cap: int, pool: ScorePool | None
                   ) -> Generator[None, None, list[tuple[int, list[int]]]]:
    """The members' shared first ``length`` tokens prefilled once into a slot of their own
    (after what the pool gave; ``cap`` tokens a call; the logits recorded for all members;
    then kept in the pool), then the members' own tokens after device copies of those rows:
    as many members a call as ``_SCORE_GROUP`` tokens of logits allow, one whose own tokens
    pass that alone, ``cap`` tokens a call. Returns the clusters its members form among
    themselves, for the caller to score next (not from this frame: its logits and cache are
    freed by then)."""
    group_cap = min(cap, _SCORE_GROUP)
    # a member's last token is fed to no call (its row would predict nothing): one token
    # after the shared ones is the last shared row's prediction, no call of its own
    own = {m: seqs[m][length:-1] for m in members if len(seqs[m]) - 1 > length}
    rest = sorted(own, key=lambda m: len(own[m]))
    capacity = max(len(seqs[m]) for m in members) + 1
    # slots for as many members as a call takes, their rows (as the cache rounds a slot's
    # capacity) under _CLUSTER_ROWS (or one)
    slots = max(1, min(len(rest), group_cap // len(own[rest[0]]) if rest else 1,
                       _CLUSTER_ROWS // chunks(capacity)))
    home = slots  # the shared rows' slot, after those the members take in turn
    kv = lm.new_cache(slots + 1, capacity=capacity)
    shared = seqs[members[0]][:length]
    scored = [acc[m] for m in members]
    first = pool.take(kv, home, shared, scored, whole=False) if pool else 0
    for start in range(first, length, cap):
        rows = lm.prefill(kv, home, [shared[start:start + cap]]).logits[0]
        record_rows(start, rows, scored)
        yield
    subs: list[tuple[int, list[int]]] = []
    if pool:
        pool.keep(kv, [(home, shared, scored[0])])
        # members that share more among themselves (a question's choices after a few-shot
        # header) form clusters of their own, which take this one's rows from the pool:
        # where the pool kept them all (else each would compute them again)
        bt = pool.prefix.block_tokens
        if pool.prefix.scored_tokens(shared, scored[0].n_top) == length // bt * bt:
            subs, loose = shared_clusters(seqs, members, length + MIN_SHARED, base=length)
            loose = set(loose)
            rest = [m for m in rest if m in loose]
    while rest:
        take = [rest.pop(0)]
        while rest and len(take) < slots and \
                (len(take) + 1) * len(own[rest[0]]) <= group_cap:
            take.append(rest.pop(0))
        for b in range(len(take)):
            kv.move(home, b)  # the shared rows, copied on the device
        if len(take) == 1:  # (alone: its own tokens in chunks of ``cap``)
            tokens = own[take[0]]
            for start in range(0, len(tokens), cap):
                acc[take[0]].record(length + start, lm.extend(
                    kv, 0, np.asarray(tokens[start:start + cap], np.int64)))
                yield
            continue
        for m, rows in zip(take, lm.prefill(kv, 0, [own[m] for m in take]).logits):
            acc[m].record(length, rows)
        yield
    return subs


def _prefill_group(lm, seqs: list[list[int]], acc: list[_Scored], pool: ScorePool | None
                   ) -> Generator[None, None, None]:
    """Short sequences, each in a slot of one private cache after what the pool gave it, their
    rests in one call (one each where the padding would pass the model's context); kept in
    the pool after."""
    kv = lm.new_cache(len(seqs), capacity=max(len(ids) for ids in seqs) + 1)
    fed: list[tuple[int, list[int], _Scored]] = []  # (start, ids, scored) by slot
    for ids, a in zip(seqs, acc):
        start = pool.take(kv, len(fed), ids, [a], whole=True) if pool else 0
        if start < len(ids):  # (else scored from the pool alone: its slot serves the next)
            fed.append((start, ids, a))
    if not fed:
        return
    longest = max(len(ids) - start for start, ids, _ in fed)
    calls = [list(range(len(fed)))] if max(start for start, _, _ in fed) + longest <= \
        lm.cfg.max_seq_len else [[b] for b in range(len(fed))]
    for slots in calls:
        res = lm.prefill(kv, slots[0], [fed[b][1][fed[b][0]:] for b in slots]).logits
        for b, rows in zip(slots, res):  # (T_b, V) each
            fed[b][2].record(fed[b][0], rows)
        yield
    if pool:
        pool.keep(kv, [(b, ids, a) for b, (_, ids, a) in enumerate(fed)])

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

import numpy as np


def take_cached(prefix, kv, slot: int, ids, scored: list, whole: bool) -> int:
    """Restore into the empty ``slot`` the cached rows of ``ids`` whose log-probabilities a
    Score kept, and record those log-probabilities into each of ``scored`` (``_Scored`` of
    sequences that begin with ``ids``). Returns where the feed starts: the rows restored (the
    last cached token is fed again, for its row's logits), 0 with nothing cached or no
    ``prefix``; ``whole`` and every token of ``ids`` cached: len(ids), nothing restored
    (nothing to feed: the sequence is scored)."""
    if prefix is None:
        return 0
    n = scored[0].n_top
    blocks, scores = prefix.scored_match(ids, n)
    try:
        covered = len(blocks) * prefix.block_tokens
        if covered < 2:  # (one token: no log-probability to copy, no row to keep)
            return 0
        lps = np.concatenate([b.lps for b in scores])[1:covered]
        top_i = np.concatenate([b.top_ids[:, :n] for b in scores])[1:covered] if n else None
        top_l = np.concatenate([b.top_lps[:, :n] for b in scores])[1:covered] if n else None
        start = covered if whole and covered == len(ids) else \
            prefix.restore(kv, slot, blocks, covered - 1)
        for s in scored:
            s.lps[:covered - 1] = lps
            if n:
                s.tops_i[:covered - 1], s.tops_l[:covered - 1] = top_i, top_l
            s.cached = start
        return start
    finally:
        prefix.release(blocks)


def keep(prefix, kv, items: list) -> None:
    """After their calls: the rows of each (slot, ids, scored) (the slot's first rows are
    ``ids``' rows) into the pool, one device copy for all, and their log-probabilities with
    the blocks."""
    if prefix is None or not items:
        return
    prefix.insert_many(kv, [(slot, ids) for slot, ids, _ in items])
    for _, ids, s in items:
        prefix.keep_scores(ids, s.lps, s.tops_i, s.tops_l)

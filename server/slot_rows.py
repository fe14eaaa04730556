"""A free KV slot's rows, taken over by the next sequence that begins with the same tokens
(llama.cpp's server keeps each slot's prompt the same way, ``cache_prompt``).

When a sequence leaves, its slot keeps its rows (the KV cache's ``retain``: copied along when
the buffers are reallocated, dropped when compaction moves a sequence into or out of the slot)
and ``SlotRows`` keeps the tokens they are of. A sequence admitted into that slot whose
prefill ids begin with those tokens takes the rows over (``reuse``) instead of restoring blocks
from the prefix cache or prefilling them.

Why beside the prefix cache: a chat client sends the whole history each turn. The slot that
served the last turn holds all of it, prompt and reply, where the cache holds whole blocks
only (up to 15 tokens of every turn are prefilled again) and its restore copies every row
into the slot once more. On the 6M bench model, a turn of 48 new user tokens after 640 cached
ones: the restore ~1.1 ms and 16 tokens more to prefill, of a ~10 ms time to first token.

Exact: the rows are the ones the prefix cache stores for those tokens (it copies them from this
slot), made by the same graph for the same prefix at the same positions. On with the prefix
cache only (``--prefix-cache-mb 0`` turns both off), for the same models.

Not thread-safe: the engine's thread owns it.
"""
from __future__ import annotations

from typing import Sequence as Seq


def common_prefix(a: Seq[int], b: Seq[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit`` (list slices compared in
    C: one comparison when all of them agree, a binary search otherwise)."""
    m = max(0, min(len(a), len(b), limit))
    if list(a[:m]) == list(b[:m]):
        return m
    lo, hi = 0, m  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class SlotRows:
    """The tokens of the rows each free slot retains (the KV cache's ``retained`` says how many
    are still there: a token list without retained rows is stale and ignored)."""

    def __init__(self):
        self._tokens: dict[int, list[int]] = {}

    def left(self, kv, slot: int, tokens: list[int] | None) -> None:
        """The sequence in ``slot`` is leaving (before compaction moves any slot): its rows are
        of ``tokens`` (None: they are not all known, keep nothing)."""
        rows = min(len(tokens), int(kv.used[slot])) if tokens else 0
        kv.retain(slot, rows)
        if rows:
            self._tokens[slot] = tokens[:rows]
        else:
            self._tokens.pop(slot, None)

    def match(self, kv, slot: int, ids: Seq[int]) -> int:
        """Rows of the free ``slot`` that are the rows of ``ids``' first tokens, leaving at
        least one id to prefill (its logits choose the first token)."""
        kept = int(kv.retained[slot])
        tokens = self._tokens.get(slot)
        if not kept or not tokens:
            return 0
        return common_prefix(tokens[:kept], ids, len(ids) - 1)

    def take(self, kv, slot: int, rows: int = 0) -> None:
        """A sequence is admitted into ``slot``: its first ``rows`` retained rows become its own
        (0: none; the slot is empty for its prefill)."""
        self._tokens.pop(slot, None)
        kv.reuse(slot, rows)

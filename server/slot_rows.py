"""A free KV slot's rows, taken over by the next sequence that begins with the same tokens
(llama.cpp's server keeps each slot's prompt the same way, ``cache_prompt``).

When a sequence leaves, its slot keeps its rows (the KV cache's ``retain``: copied along when
the buffers are reallocated, dropped when compaction moves a sequence into or out of the slot)
and ``SlotRows`` keeps the tokens they are of. A sequence admitted into that slot whose
prefill ids begin with those tokens takes the rows over (``reuse``) instead of restoring blocks
from the prefix cache or prefilling them.

Why beside the prefix cache: a chat client sends the whole history each turn. The slot that
served the last turn holds all of it, prompt and reply, where the cache's restore would copy
every row into the slot once more. On the 6M bench model, a turn of 48 new user tokens after
640 cached ones: the restore ~1.1 ms of a ~10 ms time to first token.

Exact: the rows are the ones the prefix cache stores for those tokens (it copies them from this
slot), made by the same graph for the same prefix at the same positions. On with the prefix
cache only (``--prefix-cache-mb 0`` turns both off), for the same models.

Not thread-safe: the engine's thread owns it.
"""
from __future__ import annotations

_SLICE = 64  # tokens compared at a time


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens the lists ``a`` and ``b`` share, at most ``limit``, in C-level
    list comparisons: a first token that differs (an unrelated prompt) costs one, a whole
    match (a chat's next turn) one slice each; else slices of 64, then the one that differs
    token by token (~50 us for 1,000 tokens in the worst case)."""
    m = max(0, min(len(a), len(b), limit))
    if not m or a[0] != b[0]:
        return 0
    if a[:m] == b[:m]:
        return m
    i = 0
    while a[i:i + _SLICE] == b[i:i + _SLICE]:  # (within m: the whole of it differs)
        i += _SLICE
    while a[i] == b[i]:  # (the slice from i differs: so does one of its tokens)
        i += 1
    return i


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

    def match(self, kv, slot: int, ids: list[int]) -> int:
        """Rows of the free ``slot`` that are the rows of ``ids``' first tokens, leaving at
        least one id to prefill (its logits choose the first token)."""
        kept = int(kv.retained[slot])
        tokens = self._tokens.get(slot)
        if not kept or not tokens:
            return 0
        return common_prefix(tokens, ids, min(kept, len(ids) - 1))

    def take(self, kv, slot: int, rows: int = 0) -> None:
        """A sequence is admitted into ``slot``: its first ``rows`` retained rows become its own
        (0: none; the slot is empty for its prefill)."""
        self._tokens.pop(slot, None)
        kv.reuse(slot, rows)


def pending_prefixes(unsaved: dict, kv, slot: int, ids: list[int], prefix) -> list[int]:
    """The free slots other than ``slot`` whose rows still wait for the prefix cache
    (``unsaved``: slot -> (the KV cache then, their tokens)) and hold more of ``ids``' prefix
    than the cache (``prefix``) has: copied first, they serve ``ids`` (a conversation's next
    turn admitted into another slot than the one its last turn left)."""
    limit = len(ids) - 1  # (a match leaves one token)
    found = [(s, common_prefix(tokens, ids, min(int(kv.retained[s]), limit)))
             for s, (was, tokens) in unsaved.items() if s != slot and was is kv]
    found = [(s, n) for s, n in found if n > prefix.block_tokens]
    if not found:
        return []
    have = prefix.cached_tokens(ids)
    return [s for s, n in found if n > have]

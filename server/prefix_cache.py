"""The prefix cache's index: which pool blocks hold the KV rows of which token prefixes.

Tokens are cut into blocks of ``block_tokens`` (16: see below). Block j of a sequence is keyed
by a hash chain, key_j = blake2b(key_{j-1} || token ids of block j) (vLLM's automatic prefix
caching), so a key names the block's tokens *and everything before them*: equal keys, equal
KV rows (rows depend on the prefix only; ``prefix_cache_unsupported_reason`` names the models
for which that is false). Each entry also keeps its tokens, compared on a hit: a hash collision
can cost a miss, never a wrong row.

- ``match(tokens)``: the longest cached prefix, never the whole prompt (at least one token is
  left to prefill, so there are logits to sample from): whole blocks along the chain, then,
  after at least one, the first rows of one more block, a cached block after the last one
  matched whose first tokens are the prompt's next ones (where two prompts part inside a
  block, or a block a sequence left unfinished); the blocks it returns are referenced until
  ``release``.
- ``restore(kv, slot, blocks, rows)``: their first ``rows`` rows into an empty slot (one device
  copy).
- ``insert(kv, slot, tokens)``: after a prefill (or when a sequence ends, its generated
  tokens too), the slot's blocks that are not cached yet, the unfinished last one too where a
  whole one comes before it, are copied into the pool (one device copy).
- ``keep_scores(tokens, lps, ...)`` / ``scored_match(tokens, n_top)``: Score's log-probabilities
  of a block's tokens kept with the block, and the longest run of blocks that has them
  (``server.score_cache``).
- Eviction: least recently used blocks with no references, when a new block needs room. A
  released chain enters the LRU order tail first, so a chain is evicted from its end and its
  first blocks (the most shared: system prompts) last.
- ``warm()``: where the pool's pages become resident only when first written (host memory),
  the next never-used blocks are written ahead of use, ``WARM_AHEAD_TOKENS`` rows of them,
  one ``WARM_CHUNK_BYTES`` a call: the engine calls it when idle, so that a prompt's insert in the
  middle of serving pays no page faults (a new 1,000-token prompt's insert on the 6M bench
  model, in the live engine: ~10 ms into never-written blocks, 1.0-1.4 ms into written ones,
  while every sequence of the batch waits).

Why 16 tokens a block (vLLM's default too): smaller blocks cost more Python per token (one
hash and one dict entry per block: ~1 us, so ~60 us to match 1,000 tokens) and more per-block
overhead in the copies' index arrays; larger ones waste more of the pool on unfinished blocks
(a block holds its rows whether 1 or 16 of them are filled). 16 keeps both small next to
prefilling the tokens it saves. A prefix is reused to the token, not only in whole blocks
(vLLM's is; SGLang's radix cache reuses to the token): the rows of a block's first tokens
depend on those tokens and the ones before them only, so a block whose first m tokens are the
prompt's next m serves m rows (the load copies the whole block; the slot's ``used`` counts m,
and the prefill writes over the rest). Without it a request lost up to 15 cached tokens: a
chat turn's unfinished block, or the block where a prompt parts from a cached one.

Not thread-safe: the engine's scheduler thread owns it.
"""
from __future__ import annotations

import array
import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

BLOCK_TOKENS = 16
PARTIAL_CANDIDATES = 32  # blocks compared at most for the rows of one more block (``_partial``)
ROOT = b""  # the parent key of a sequence's first block
KEPT_TOP = 20  # top tokens a position keeps at most with its log-probability (Score; the
# server's default --max-top-logprobs): ~4 KB a block of host memory beside the pool
WARM_AHEAD_TOKENS = 2048  # the rows of never-used blocks kept resident ahead of use (host
# pools): a long prompt's worth (6M bench model: 4 MB; 100M: 50 MB, within the pool's cap)
WARM_CHUNK_BYTES = 1 << 20  # ... written per ``warm`` call (~0.5 ms of page faults)


def prefix_cache_unsupported_reason(cfg) -> str | None:
    """Why a model's KV rows are not a function of their prefix alone (None: they are)."""
    if cfg.longrope_limit is not None:
        return ("LongRoPE switches every row's rotary factors when a sequence grows past "
                f"{cfg.longrope_limit} tokens, so a row depends on the sequence's final length")
    return None


def block_key(parent: bytes, tokens) -> bytes:
    """The hash-chain key of a block of token ids after the block keyed ``parent``."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array.array("q", tokens).tobytes())
    return h.digest()


def shared_blocks(a, b, block_tokens: int = BLOCK_TOKENS) -> int:
    """Whole blocks two prompts share from their start (the engine holds back a request that
    shares uncached blocks with one being prefilled now, so that the prefix is computed once
    and the second request restores it once the first one's ``insert`` is done)."""
    n = 0
    limit = min(len(a), len(b)) // block_tokens
    while n < limit and a[n * block_tokens:(n + 1) * block_tokens] == \
            b[n * block_tokens:(n + 1) * block_tokens]:
        n += 1
    return n


def prefill_now(prompts: list, cached: list[int], block_tokens: int = BLOCK_TOKENS
                ) -> list[bool]:
    """Which of the prompts admitted together (in order) are prefilled in this round, together:
    one waits for a later round where an earlier one of this round shares more whole blocks
    with it than the cache covers of it now (``cached``: each one's tokens), so that a shared
    prefix is computed once: inserted after this round, its rows are the waiting one's then.
    The first one never waits."""
    now: list[int] = []
    out = []
    for j, p in enumerate(prompts):
        cap = (len(p) - 1) // block_tokens  # (a match leaves one token to compute)
        wait = any(min(shared_blocks(prompts[i], p, block_tokens), cap) * block_tokens
                   > cached[j] for i in now)
        if not wait:
            now.append(j)
        out.append(not wait)
    return out


@dataclass(frozen=True)
class BlockScores:
    """What a Score computed at a whole block's positions (``keep_scores``): each token's
    log-probability given the tokens before it (a sequence's first token has none: 0, never
    read) and the ``n`` most likely tokens there, ids and log-probabilities (n may be 0)."""
    lps: np.ndarray  # (block_tokens,) float32
    top_ids: np.ndarray  # (block_tokens, n) int64
    top_lps: np.ndarray  # (block_tokens, n) float32


@dataclass
class _Block:
    key: bytes
    tokens: bytes  # the block's ids as int64 bytes (compared on a hit; fewer than
    # block_tokens of them: a block a sequence left unfinished)
    parent: bytes = ROOT  # the key of the block before it
    refs: int = 0
    probation: bool = False  # kept by a Score and not used since: evicted before the others
    scores: BlockScores | None = None  # its positions' log-probabilities, where a Score kept
    # them (a property of the prefix, as the rows are; host memory, ~4 KB a block at most:
    # ``KEPT_TOP``)

    @property
    def sibling_key(self) -> tuple[bytes, bytes]:
        return self.parent, self.tokens[:8]  # (where it hangs: its parent and first token)


class PrefixCache:
    """The index over a pool (``kvserve.artifact.prefix_pool``): ``pool.n_blocks`` blocks of
    ``pool.block_tokens`` tokens; ``pool.save`` / ``pool.load`` do the copies."""

    def __init__(self, pool):
        self.pool = pool
        self.block_tokens = pool.block_tokens
        self._by_key: dict[bytes, int] = {}  # key -> block id
        self._blocks: dict[int, _Block] = {}  # block id -> entry (cached blocks)
        # (parent key, first token's bytes) -> the cached blocks there, oldest first
        # (``_partial``), and the unfinished ones among them (``_add``)
        self._siblings: dict[tuple[bytes, bytes], dict[int, None]] = {}
        self._unfinished: dict[tuple[bytes, bytes], dict[int, None]] = {}
        self._free: list[int] = list(range(pool.n_blocks - 1, -1, -1))  # never used yet
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks
        # ... those on probation (a Score's, not used since), evicted first: one-off Score
        # sequences only push out each other, never a chat's history (2Q's probation queue)
        self._probation: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0
        # False: whole blocks only, matched and cached (vLLM's way; the bench's comparison,
        # bench/prefix_tokens.py)
        self.to_the_token = True
        self._warm: set[int] = set()  # free blocks already written (resident): ``warm``
        self._warmed = False  # every block ``warm`` would write is written (until a take)
        lazy = getattr(pool, "lazy", False)
        self._ahead = max(1, WARM_AHEAD_TOKENS // self.block_tokens) if lazy else 0
        self._chunk = max(1, WARM_CHUNK_BYTES // pool.block_bytes)

    # --- what the engine calls ----------------------------------------------------------------
    def match(self, tokens) -> tuple[list[int], int]:
        """The longest cached prefix of ``tokens``, leaving at least one token: (block ids,
        tokens covered; the last block's first rows only where that is not a multiple of
        ``block_tokens``). The blocks are referenced (never evicted) until
        ``release(blocks)``."""
        blocks, covered = self._matched(tokens)
        for bid in blocks:
            self._acquire(bid, used=True)
        return blocks, covered

    def cached_tokens(self, tokens) -> int:
        """The tokens ``match`` would cover now (no reference taken)."""
        return self._matched(tokens)[1]

    def has_prefix(self, tokens) -> bool:
        """Whether ``match`` would find at least one block (the first block's hash only; no
        reference taken)."""
        if (len(tokens) - 1) // self.block_tokens < 1:
            return False
        return self._cached(*next(iter(self._chain(tokens, self.block_tokens)))) is not None

    def cacheable(self, rows: int) -> int:
        """How many of a slot's first ``rows`` rows ``insert`` caches: all of them past a whole
        block (to the token), else whole blocks only (an unfinished first block could serve no
        match; ``to_the_token`` False: always whole blocks)."""
        whole = rows // self.block_tokens * self.block_tokens
        return rows if self.to_the_token and rows > self.block_tokens else whole

    def restore(self, kv, slot: int, blocks: list[int], rows: int) -> int:
        """The blocks' first ``rows`` rows (``match``'s count: the last block may count
        fewer than its size) into the empty ``slot`` (its ``used`` becomes ``rows``); the rest
        of the prompt is then prefilled after them. Returns the rows restored."""
        whole = len(blocks) * self.block_tokens
        if not whole - self.block_tokens < rows <= whole:
            raise ValueError(f"{rows} rows from {len(blocks)} blocks")
        self.pool.load(kv, slot, blocks)
        if rows < whole:
            kv.truncate(slot, rows)  # (the last block's other rows: written over next)
        return rows

    def release(self, blocks: list[int]) -> None:
        """Drop the references ``match`` took (after ``restore``, or if the request is
        dropped). A block nobody references becomes evictable, the chain's end first."""
        for bid in reversed(blocks):
            b = self._blocks[bid]
            if b.refs <= 0:
                raise ValueError(f"block {bid} released more often than matched")
            b.refs -= 1
            if b.refs == 0:
                (self._probation if b.probation else self._lru)[bid] = None

    def insert(self, kv, slot: int, tokens) -> int:
        """Register the blocks of ``tokens`` whose rows ``slot`` holds (its first
        ``kv.used[slot]`` rows must be exactly these tokens' rows, in order; the last block
        unfinished where a whole one comes before it), copying the blocks not cached yet into
        the pool (one device copy). Blocks already cached are
        refreshed in the LRU order. When every block is referenced, fewer blocks (a shorter
        prefix) are cached. Returns the number of blocks copied."""
        return self.insert_many(kv, [(slot, tokens)])

    def insert_many(self, kv, items, probation: bool = False) -> int:
        """``insert`` for several (slot, tokens) at once: one device copy for all of their new
        blocks (a batched prefill's prompts; the sequences leaving at one step). A block two
        of them share is copied once, from the first. ``probation`` (a Score's rows): the new
        blocks are evicted before any other until a request takes them; otherwise a block on
        probation found here is in use again (a generation made the same rows)."""
        chain: list[int] = []  # their blocks, held while evicting for the new ones
        blocks: list[tuple[int, int]] = []  # (slot, j) of each new block
        pool_blocks: list[int] = []
        try:
            for slot, tokens in items:
                rows = self.cacheable(min(len(tokens), int(kv.used[slot])))
                parent = ROOT
                for j, (key, chunk) in enumerate(self._chain(tokens, rows)):
                    bid = self._by_key.get(key)
                    if bid is not None and self._blocks[bid].tokens != chunk:
                        break  # a hash collision: keep the cached block, stop here
                    if bid is None:
                        bid = self._take()
                        if bid is None:
                            break  # every block is in use
                        self._add(bid, _Block(key, chunk, parent, probation=probation))
                        blocks.append((slot, j))
                        pool_blocks.append(bid)
                    else:
                        self._blocks[bid].probation &= probation
                    self._acquire(bid)
                    chain.append(bid)
                    parent = key
            self.pool.save(kv, blocks, pool_blocks)
        except BaseException:
            new = set(pool_blocks)
            for bid in pool_blocks:  # the copy did not happen: forget the new entries
                self._forget(bid)
            chain = [b for b in chain if b not in new]
            raise
        finally:
            self.release(chain)
        return len(pool_blocks)

    def scored_match(self, tokens, n_top: int) -> tuple[list[int], list[BlockScores]]:
        """Score's ``match``: the longest run of whole cached blocks from ``tokens``' start
        whose positions a Score kept (``keep_scores``) with ``n_top`` top tokens or more:
        (block ids, their scores), the whole of ``tokens`` possibly. Referenced until
        ``release``."""
        blocks, scores = self._scored(tokens, n_top)
        for bid in blocks:
            self._acquire(bid, used=True)
        return blocks, scores

    def scored_tokens(self, tokens, n_top: int = 0) -> int:
        """The tokens ``scored_match`` would cover now (no reference taken)."""
        return len(self._scored(tokens, n_top)[0]) * self.block_tokens

    def _scored(self, tokens, n_top: int) -> tuple[list[int], list[BlockScores]]:
        blocks: list[int] = []
        scores: list[BlockScores] = []
        bt = self.block_tokens
        for key, chunk in self._chain(tokens, len(tokens) // bt * bt):
            bid = self._cached(key, chunk)
            b = None if bid is None else self._blocks[bid]
            if b is None or b.scores is None or b.scores.top_ids.shape[1] < n_top:
                break
            blocks.append(bid)
            scores.append(b.scores)
        return blocks, scores

    def keep_scores(self, tokens, lps, top_ids=None, top_lps=None) -> int:
        """Keep a Score's log-probabilities of ``tokens`` (``lps[k]``: of tokens[k + 1]; the
        top ones (len(tokens) - 1, n) likewise, or None; at most ``KEPT_TOP`` of them) with
        the cached whole blocks of ``tokens`` (``insert`` them first) that keep none, or fewer
        top tokens. Returns how many blocks took them."""
        bt, T = self.block_tokens, len(tokens)
        n = 0 if top_ids is None else min(top_ids.shape[1], KEPT_TOP)
        lp = np.zeros(T, np.float32)  # position p: tokens[p]'s (the first: none)
        lp[1:] = lps[:T - 1]
        ti, tl = np.zeros((T, n), np.int64), np.zeros((T, n), np.float32)
        if n:  # (by descending log-probability: the first n are the n most likely)
            ti[1:], tl[1:] = top_ids[:T - 1, :n], top_lps[:T - 1, :n]
        kept = 0
        for j, (key, chunk) in enumerate(self._chain(tokens, T // bt * bt)):
            bid = self._cached(key, chunk)
            if bid is None:
                break
            b = self._blocks[bid]
            if b.scores is None or b.scores.top_ids.shape[1] < n:
                part = slice(j * bt, (j + 1) * bt)
                b.scores = BlockScores(lp[part].copy(), ti[part].copy(), tl[part].copy())
                kept += 1
        return kept

    @property
    def warm_pending(self) -> bool:
        """Some of the next ``WARM_AHEAD_TOKENS`` rows' never-used blocks are not written yet."""
        return bool(self._ahead and self._free) and not self._warmed

    def warm(self) -> int:
        """Write the next never-used blocks not written yet, up to ``WARM_CHUNK_BYTES`` (the
        free list's tail: the blocks ``_take`` hands out next). Returns how many."""
        if not self._ahead:
            return 0
        todo = [b for b in reversed(self._free[-self._ahead:]) if b not in self._warm]
        self._warmed = len(todo) <= self._chunk
        todo = todo[:self._chunk]
        if todo:
            self.pool.touch(todo)
            self._warm.update(todo)
        return len(todo)

    # --- state -------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """The pool's bytes (allocated once, at most the cap)."""
        return self.pool.nbytes

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    @property
    def referenced_blocks(self) -> int:
        return sum(1 for b in self._blocks.values() if b.refs)

    def check(self) -> None:
        """Internal consistency (tests): every block is free, cached-unreferenced (in the LRU
        order) or referenced, exactly once, and (after a whole block) listed under its parent
        and first token."""
        assert len(self._by_key) == len(self._blocks) <= self.pool.n_blocks
        assert not set(self._lru) & set(self._probation)
        assert set(self._lru) == {i for i, b in self._blocks.items()
                                  if b.refs == 0 and not b.probation}
        assert set(self._probation) == {i for i, b in self._blocks.items()
                                        if b.refs == 0 and b.probation}
        assert not set(self._free) & set(self._blocks)
        assert len(self._free) + len(self._blocks) == self.pool.n_blocks
        assert all(self._by_key[b.key] == i for i, b in self._blocks.items())
        bt = self.block_tokens * 8
        for index, which in ((self._siblings, lambda b: True),
                             (self._unfinished, lambda b: len(b.tokens) < bt)):
            listed = [(k, i) for k, ids in index.items() for i in ids]
            assert all(ids for ids in index.values())
            assert sorted(listed) == sorted((b.sibling_key, i) for i, b in self._blocks.items()
                                            if b.parent != ROOT and which(b))

    # --- internals ---------------------------------------------------------------------------
    def _matched(self, tokens) -> tuple[list[int], int]:
        """(blocks, tokens covered) of ``match``, no reference taken."""
        bt, limit = self.block_tokens, len(tokens) - 1  # (one token is left to compute)
        blocks: list[int] = []
        parent = ROOT
        for key, chunk in self._chain(tokens, limit // bt * bt):
            bid = self._cached(key, chunk)
            if bid is None:
                break
            blocks.append(bid)
            parent = key
        covered = len(blocks) * bt
        if not self.to_the_token:
            return blocks, covered
        bid, m = self._partial(parent, tokens[covered:min(covered + bt, limit)])
        if m:
            blocks.append(bid)
        return blocks, covered + m

    def _cached(self, key: bytes, chunk: bytes) -> int | None:
        """The block cached under ``key`` if it holds ``chunk`` (else a hash collision, or
        nothing there: None)."""
        bid = self._by_key.get(key)
        return bid if bid is not None and self._blocks[bid].tokens == chunk else None

    def _partial(self, parent: bytes, ids) -> tuple[int | None, int]:
        """The cached block after ``parent`` (a whole block: not the root) whose first tokens
        are most of ``ids`` (fewer than a block), and how many: (None, 0) where none begins
        with ids[0]. Looks at the newest ``PARTIAL_CANDIDATES`` of them (requests that share a
        prefix and part right after it hang many blocks there; any of them is exact, the
        longest saves the most; a continuation mostly follows a recent request), each
        compared in a binary search over its tokens."""
        if not len(ids) or parent == ROOT:
            return None, 0
        want = array.array("q", ids).tobytes()
        best, most = None, 0
        for bid in itertools.islice(reversed(self._siblings.get((parent, want[:8]), {})),
                                    PARTIAL_CANDIDATES):
            have = self._blocks[bid].tokens
            lo, hi = 1, min(len(have), len(want)) // 8  # (the first token agrees)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if have[:mid * 8] == want[:mid * 8]:
                    lo = mid
                else:
                    hi = mid - 1
            if lo > most:
                best, most = bid, lo
        return best, most

    def _chain(self, tokens, n_tokens: int):
        """(key, token bytes) of the blocks of ``tokens``' first ``n_tokens``, lazily (a
        lookup stops at the first miss): one conversion of the ids to bytes, then one
        blake2b per block over a slice of them; the last block shorter than the others where
        ``n_tokens`` is not a multiple of ``block_tokens``."""
        bt = self.block_tokens
        if n_tokens <= 0:
            return
        step = bt * 8
        data = array.array("q", tokens[:n_tokens]).tobytes()
        key = ROOT
        for j in range(-(-n_tokens // bt)):
            chunk = data[j * step:(j + 1) * step]
            h = hashlib.blake2b(key, digest_size=16)
            h.update(chunk)
            key = h.digest()
            yield key, chunk

    def _add(self, bid: int, block: _Block) -> None:
        """A new cached block, listed beside its siblings where it is not a first block (those
        ``_partial`` never looks at); unreferenced unfinished blocks there whose tokens begin
        its own (a whole block's, or a longer unfinished one's) are dropped: it serves every
        prefix they did. (Only the unfinished ones are compared: at most one a request.)"""
        self._blocks[bid] = block
        self._by_key[block.key] = bid
        if block.parent == ROOT:
            return
        key = block.sibling_key
        for other in [b for b in self._unfinished.get(key, ())
                      if self._blocks[b].refs == 0
                      and len(self._blocks[b].tokens) < len(block.tokens)
                      and block.tokens.startswith(self._blocks[b].tokens)]:
            self._forget(other)  # (may leave the lists empty, and delete them)
        self._siblings.setdefault(key, {})[bid] = None
        if len(block.tokens) < self.block_tokens * 8:
            self._unfinished.setdefault(key, {})[bid] = None

    def _unlist(self, block: _Block, bid: int) -> None:
        del self._by_key[block.key]
        if block.parent == ROOT:
            return
        for index in (self._siblings, self._unfinished):
            here = index.get(block.sibling_key)
            if here is not None:
                here.pop(bid, None)
                if not here:
                    del index[block.sibling_key]

    def _acquire(self, bid: int, used: bool = False) -> None:
        """A reference to ``bid``; ``used``: a request takes its rows (off probation)."""
        b = self._blocks[bid]
        if b.refs == 0:
            self._lru.pop(bid, None)
            self._probation.pop(bid, None)
        b.refs += 1
        b.probation = b.probation and not used

    def _take(self) -> int | None:
        """A block id for new rows: a never-used one, else the least recently used
        unreferenced one (evicted)."""
        if self._free:
            bid = self._free.pop()
            self._warm.discard(bid)
            self._warmed = False  # (the blocks ahead moved on by one)
            return bid
        if not self._lru and not self._probation:
            return None
        bid, _ = (self._probation or self._lru).popitem(last=False)
        self._unlist(self._blocks.pop(bid), bid)
        self.evictions += 1
        return bid

    def _forget(self, bid: int) -> None:
        b = self._blocks.pop(bid, None)
        if b is not None:
            self._unlist(b, bid)
            self._lru.pop(bid, None)
            self._probation.pop(bid, None)
            self._free.append(bid)
            self._warmed = False

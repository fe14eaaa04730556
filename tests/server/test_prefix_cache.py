"""The prefix cache's index (``kvserve.server.prefix_cache``) over a real pool and a real KV
cache (``NumpyPrefixPool`` + the portable runner's ``KVBuffers``, no model needed): each row
holds a number derived from its whole prefix (a rolling hash), so a restored row that belongs
to another prefix is caught. Matching to the token (whole blocks, then the first rows of one
more: a block where prompts part, or one a sequence left unfinished), never the whole prompt;
the hash chain; references; tail-first LRU eviction; 2,000 mixed random requests under pressure with the pool
never past its cap; which models are excluded. (The device copies and the exactness of a
restored prefix through the runners: tests/artifact/test_prefix_pool.py and
tests/export/test_prefix_matrix.py.)"""
from __future__ import annotations

import random

import numpy as np
import pytest
from export_matrix import make_config

from kvserve.artifact.portable import KVBuffers
from kvserve.artifact.prefix_pool import NumpyPrefixPool, block_bytes
from kvserve.model.config import ModelConfig
from kvserve.server.prefix_cache import (BLOCK_TOKENS, PrefixCache, block_key,
                                         prefix_cache_unsupported_reason, shared_blocks)

CFG = make_config("llama")
BT = BLOCK_TOKENS


def row_values(tokens) -> list[float]:
    """Per position t, a number that depends on tokens[:t + 1] (exact in float32)."""
    out, h = [], 0
    for tok in tokens:
        h = (h * 1_000_003 + int(tok) + 1) % (1 << 20)
        out.append(float(h))
    return out


def prefill(kv: KVBuffers, slot: int, tokens) -> None:
    """A stand-in for the model's prefill of the rows after ``kv.used[slot]``: each row holds
    its prefix's number (keys) and its negative (values) in every layer."""
    start = int(kv.used[slot])
    kv.ensure_capacity(len(tokens) + 1)
    vals = np.asarray(row_values(tokens), np.float32)[start:]
    for i in range(CFG.n_layers):
        kv.k[i][slot, :, start:len(tokens)] = (vals + i)[None, :, None]
        kv.v[i][slot, :, start:len(tokens)] = -(vals + i)[None, :, None]
    kv.mask[slot, :len(tokens)] = 1
    kv.used[slot] = len(tokens)


def assert_rows_of(kv: KVBuffers, slot: int, tokens) -> None:
    n = int(kv.used[slot])
    vals = np.asarray(row_values(tokens[:n]), np.float32)
    for i in range(CFG.n_layers):
        assert np.array_equal(kv.k[i][slot, :, :n], np.broadcast_to((vals + i)[None, :, None],
                                                                    kv.k[i][slot, :, :n].shape))
        assert np.array_equal(kv.v[i][slot, :, :n], -kv.k[i][slot, :, :n])


def serve(cache: PrefixCache, kv: KVBuffers, tokens) -> int:
    """One request as the engine runs it: match, restore into the emptied slot, release,
    prefill the rest, insert. Returns the cached tokens used."""
    kv.clear(0)
    blocks, n = cache.match(tokens)
    assert cache.restore(kv, 0, blocks, n) == n == kv.used[0]
    cache.release(blocks)
    assert_rows_of(kv, 0, tokens)  # every restored row belongs to this prefix
    prefill(kv, 0, tokens)
    cache.insert(kv, 0, tokens)
    return n


def new_cache(n_blocks: int) -> PrefixCache:
    return PrefixCache(NumpyPrefixPool(CFG, n_blocks, BT))


def test_match_is_to_the_token_and_never_the_whole_prompt():
    cache, kv = new_cache(8), KVBuffers(CFG, 1)
    toks = list(range(100, 148))  # 3 blocks
    assert serve(cache, kv, toks) == 0
    assert cache.cached_blocks == 3
    for length, want in ((1, 0), (2, 0), (16, 0), (17, 16), (18, 17), (32, 31), (33, 32),
                         (48, 47), (49, 48), (200, 48)):
        prompt = toks + list(range(length - 48)) if length > 48 else toks[:length]
        blocks, n = cache.match(prompt)
        assert n == want == cache.cached_tokens(prompt), length
        assert len(blocks) == -(-want // BT)
        cache.release(blocks)
    for cut in (5, 16, 20, 31):  # the prompt parts from the cached one at token ``cut``
        # (to the token after a whole block: within the first one, nothing)
        blocks, n = cache.match(toks[:cut] + [7] + toks[cut + 1:40])
        assert n == (cut if cut >= BT else 0), cut
        cache.release(blocks)
    assert serve(cache, kv, toks[:20] + [7] + toks[21:40]) == 20
    assert serve(cache, kv, toks[:20] + [7] + toks[21:40]) == 39  # its own unfinished block
    cache.check()


def test_unfinished_blocks_are_cached_and_give_way_to_whole_ones():
    """A sequence's last, unfinished block is cached too (a chat turn's end: the next turn
    restores it, not only the whole blocks); once a longer sequence fills that block, the
    unfinished copy (unreferenced) is dropped for it, and a referenced one is kept."""
    cache, kv = new_cache(8), KVBuffers(CFG, 1)
    turn = list(range(100, 140))  # 2 whole blocks and 8 rows
    assert serve(cache, kv, turn) == 0 and cache.cached_blocks == 3
    nxt = turn + list(range(700, 720))
    assert serve(cache, kv, nxt) == 40  # every row of the earlier turn
    assert cache.cached_blocks == 4  # blocks 0-2 whole, 12 rows of block 3; the 8-row one gone
    held, n = cache.match(nxt + [5])
    assert n == 60
    longer = nxt + list(range(900, 920))
    prefill(kv, 0, longer)
    kv.clear(0)
    prefill(kv, 0, longer)
    assert cache.insert(kv, 0, longer) == 2  # block 3 whole (the 12-row one is held), block 4
    assert cache.cached_blocks == 6
    cache.release(held)
    for prompt, want in ((nxt + [5], 60), (longer + [5], 80), (turn + [1], 40)):
        blocks, n = cache.match(prompt)
        assert n == want
        cache.release(blocks)
    cache.check()


def test_short_prompts_take_no_block_and_leave_the_others_be():
    """A prompt of fewer than 16 tokens has no whole block: nothing of it is cached (an
    unfinished first block could serve no match), so a stream of them evicts nothing."""
    cache, kv = new_cache(4), KVBuffers(CFG, 1)
    doc = list(range(100, 149))  # 3 whole blocks and 1 row: the whole pool
    serve(cache, kv, doc)
    for i in range(20):
        assert serve(cache, kv, [200 + i] * 8) == 0
        assert serve(cache, kv, list(range(300 + i, 315 + i))) == 0
    assert cache.evictions == 0 and cache.cached_tokens(doc) == 48
    cache.check()


def test_many_blocks_parting_after_one_prefix_are_compared_a_bounded_number():
    """Requests that share a prefix and part right after it hang their blocks beside each
    other: the rows of one more block come from one of at most ``PARTIAL_CANDIDATES`` of them,
    and any of them is the prompt's own (the rows encode their whole prefix)."""
    from kvserve.server.prefix_cache import PARTIAL_CANDIDATES

    cache, kv = new_cache(256), KVBuffers(CFG, 1)
    head = list(range(100, 116)) + [7, 8, 9]  # a whole block, then 3 shared tokens
    n = 3 * PARTIAL_CANDIDATES
    prompts = [head + [1000 + i] * 5 for i in range(n)]
    for p in prompts:  # each one's unfinished block: 8 rows (3 shared, 5 its own)
        serve(cache, kv, p)
    assert serve(cache, kv, head + [5000]) == len(head)
    assert serve(cache, kv, prompts[-1] + [1]) == len(prompts[-1])  # the newest are compared
    # the requests leave with 4 more tokens each: every 8-row block gives way to the 12-row
    # block that begins with it, also past the compared ones (1 + n blocks, not 1 + 2n)
    for i, p in enumerate(prompts):
        longer = p + [2000 + i] * 4
        kv.clear(0)
        prefill(kv, 0, longer)
        cache.insert(kv, 0, longer)
    assert cache.cached_blocks == 1 + n + 2  # (+ the two probes' blocks)
    cache.check()


def test_whole_blocks_only_when_asked():
    """``to_the_token`` False (the bench's comparison): matched and cached in whole blocks."""
    cache, kv = new_cache(8), KVBuffers(CFG, 1)
    cache.to_the_token = False
    toks = list(range(100, 140))
    assert serve(cache, kv, toks) == 0 and cache.cached_blocks == 2
    assert serve(cache, kv, toks[:20] + [7] + toks[21:40]) == 16
    assert serve(cache, kv, toks + [1]) == 32
    cache.check()


def test_a_block_is_keyed_by_its_whole_prefix():
    """The same 16 tokens after a different first block are a different block."""
    cache, kv = new_cache(8), KVBuffers(CFG, 1)
    a, b, shared = [1] * 16, [2] * 16, list(range(16))
    serve(cache, kv, a + shared + [9])
    assert cache.match(b + shared + [9])[1] == 0
    assert cache.match(a + shared + [9])[1] == 32
    assert block_key(b"", a) != block_key(b"", b) and len(block_key(b"", a)) == 16


def test_insert_copies_only_new_blocks_and_generated_rows_count():
    cache, kv = new_cache(8), KVBuffers(CFG, 1)
    toks = list(range(40))
    prefill(kv, 0, toks)
    assert cache.insert(kv, 0, toks) == 3  # rows 0..31, and 32..39 unfinished
    assert cache.insert(kv, 0, toks) == 0  # already there
    more = toks + list(range(500, 530))  # generated tokens: their rows exist now
    prefill(kv, 0, more)
    assert cache.insert(kv, 0, more) == 3  # blocks 2 and 3 (rows 32..63), 64..69 unfinished
    assert cache.cached_blocks == 5  # (the 8-row block 2 gave way to the whole one)
    assert cache.insert(kv, 0, more + [1] * 40) == 0  # tokens past the slot's rows: ignored
    cache.check()


def test_insert_many_is_one_copy_and_a_shared_block_is_copied_once(monkeypatch):
    """Several slots' tokens inserted together (a batched prefill's prompts, the sequences
    leaving at one step): one device copy for all their new blocks; a block two of them share
    (same prefix) is copied once, from the first; each restores its own rows. If the copy
    fails, none of the new entries stays (a later match would restore rows never written)."""
    cache, kv = new_cache(16), KVBuffers(CFG, 3)
    a, b = list(range(40)), list(range(16)) + list(range(700, 740))  # b shares a's block 0
    c = list(range(300, 333))
    for slot, toks in enumerate((a, b, c)):
        prefill(kv, slot, toks)
    saves = []
    real = cache.pool.save
    monkeypatch.setattr(cache.pool, "save", lambda kv_, blocks, ids: (
        saves.append(list(blocks)), real(kv_, blocks, ids))[1])
    assert cache.insert_many(kv, [(0, a), (1, b), (2, c)]) == 3 + 3 + 3
    assert saves == [[(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2)]]
    for toks in (a, b, c):
        blocks, n = cache.match(toks)
        assert n == len(toks) - 1
        kv.clear(0)
        cache.restore(kv, 0, blocks, n)
        cache.release(blocks)
        assert_rows_of(kv, 0, toks)
    cache.check()
    monkeypatch.setattr(cache.pool, "save", lambda *a: (_ for _ in ()).throw(RuntimeError()))
    before = cache.cached_blocks
    d, e = list(range(900, 940)), list(range(960, 990))
    prefill(kv, 1, d)
    prefill(kv, 2, e)
    with pytest.raises(RuntimeError):
        cache.insert_many(kv, [(1, d), (2, e)])
    assert cache.cached_blocks == before and cache.match(d) == ([], 0)
    cache.check()


def test_referenced_blocks_are_never_evicted():
    """A matched prefix stays while other requests fill the pool many times over; its rows
    are intact when restored afterwards. With every block referenced, insert caches less."""
    cache, kv = new_cache(6), KVBuffers(CFG, 1)
    held = list(range(1000, 1049))
    serve(cache, kv, held)
    blocks, n = cache.match(held)
    assert n == 48
    rnd = random.Random(0)
    for _ in range(30):
        serve(cache, kv, [rnd.randrange(300) for _ in range(rnd.randrange(20, 80))])
    assert cache.evictions > 0
    kv.clear(0)
    cache.restore(kv, 0, blocks, n)
    assert_rows_of(kv, 0, held)
    other, _ = cache.match(held)  # a second reference to the same blocks
    assert other == blocks
    prefill(kv, 0, held + list(range(60)))
    assert cache.insert(kv, 0, held + list(range(60))) <= 3  # 6 blocks, 3 held
    cache.release(blocks)
    cache.release(other)
    with pytest.raises(ValueError, match="released more often"):
        cache.release(blocks)
    cache.check()


def test_eviction_takes_the_least_recent_chain_from_its_end():
    cache, kv = new_cache(5), KVBuffers(CFG, 1)
    a = list(range(49))  # 3 whole blocks and 1 row
    b = list(range(200, 232))  # 2 whole blocks: two must go, a's last ones
    serve(cache, kv, a)
    serve(cache, kv, b)
    assert cache.evictions == 1  # a's unfinished block (the pool had one free)
    assert cache.cached_tokens(a) == 48 and cache.cached_tokens(b) == 31
    cache.check()
    c = list(range(400, 417))  # a whole block and 1 row: two go, a's last whole ones
    serve(cache, kv, c)
    assert cache.evictions == 3
    assert cache.cached_tokens(a) == 16 and cache.cached_tokens(b) == 31
    cache.check()


def test_2000_mixed_requests_stay_under_the_cap():
    """Shared system prompts, chat histories growing turn by turn, and random one-offs in a
    pool of 24 blocks: every restored row is its own prefix's, the pool's bytes never change
    (allocated once at the cap), the index never holds more than the pool, and the cache
    still hits under pressure."""
    cap = 24 * block_bytes(CFG, BT, 4) + 100  # not a whole number of blocks: rounded down
    pool = NumpyPrefixPool(CFG, cap // block_bytes(CFG, BT, 4), BT)
    cache, kv = PrefixCache(pool), KVBuffers(CFG, 1)
    rnd = random.Random(2000)
    systems = [[rnd.randrange(300) for _ in range(rnd.randrange(20, 70))] for _ in range(4)]
    chats: list[list[int]] = [[] for _ in range(6)]
    hit = total = 0
    for i in range(2000):
        kind = rnd.random()
        if kind < 0.4:
            toks = rnd.choice(systems) + [rnd.randrange(300) for _ in range(rnd.randrange(1, 30))]
        elif kind < 0.8:
            c = rnd.randrange(len(chats))
            chats[c] += [rnd.randrange(300) for _ in range(rnd.randrange(5, 25))]
            if len(chats[c]) > 250:
                chats[c] = []
            toks = chats[c] + [1]
        else:
            toks = [rnd.randrange(300) for _ in range(rnd.randrange(1, 120))]
        hit += serve(cache, kv, toks)
        total += len(toks)
        assert pool.nbytes == 24 * block_bytes(CFG, BT, 4) <= cap
        assert cache.cached_blocks <= pool.n_blocks and cache.referenced_blocks == 0
        if i % 100 == 0:
            cache.check()
    cache.check()
    assert cache.evictions > 500 and hit > 0.2 * total, (cache.evictions, hit, total)
    print(f"2000 requests: {hit}/{total} prompt tokens from the cache, "
          f"{cache.evictions} evictions, pool {pool.nbytes} bytes (cap {cap})")


def test_longrope_is_excluded_with_a_reason():
    assert prefix_cache_unsupported_reason(CFG) is None
    assert prefix_cache_unsupported_reason(make_config("gpt2")) is None
    cfg = ModelConfig(**{**CFG.__dict__, "rope_scaling": dict(
        type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
        original_max_position_embeddings=64, attention_factor=1.2)})
    why = prefix_cache_unsupported_reason(cfg)
    assert why is not None and "LongRoPE" in why and "64 tokens" in why


def test_shared_blocks_counts_whole_blocks_from_the_start():
    a = list(range(40))
    assert shared_blocks(a, a) == 2
    assert shared_blocks(a, a[:31]) == 1
    assert shared_blocks(a, a[:16] + [0] + a[17:]) == 1
    assert shared_blocks(a, [99] + a[1:]) == 0
    assert shared_blocks(a, a, block_tokens=8) == 5


def test_warming_writes_only_the_free_blocks_handed_out_next(monkeypatch):
    """``warm`` writes the never-used blocks ahead of use (their pages resident before a save
    needs them), a chunk a call, never a cached block: every cached prefix restores its own
    rows afterwards; a take moves the window on, and warming resumes."""
    import kvserve.server.prefix_cache as PCM

    monkeypatch.setattr(PCM, "WARM_AHEAD_TOKENS", 6 * BT)
    monkeypatch.setattr(PCM, "WARM_CHUNK_BYTES", 4 * block_bytes(CFG, BT, 4))
    cache, kv = new_cache(16), KVBuffers(CFG, 1)
    touched: list[list[int]] = []
    touch = cache.pool.touch
    cache.pool.touch = lambda blocks: (touched.append(sorted(blocks)), touch(blocks))[1]
    prompts = [list(range(100, 148)), list(range(300, 333))]  # 3 and 2 + 1 row cached
    for p in prompts:
        serve(cache, kv, p)
    assert cache.warm_pending
    assert cache.warm() == 4 and cache.warm_pending  # a chunk, then the rest of the window
    assert cache.warm() == 2 and not cache.warm_pending
    assert cache.warm() == 0
    assert touched == [[6, 7, 8, 9], [10, 11]]  # the next 6 free ones, none of the 6 cached
    for i in range(CFG.n_layers):
        assert not cache.pool.k[i][6:12].any() and not cache.pool.v[i][6:12].any()
    for p in prompts:  # the cached rows are intact
        assert serve(cache, kv, p) == len(p) - 1
    serve(cache, kv, list(range(500, 517)))  # takes blocks 6 and 7: the window moves on
    assert cache.warm_pending and cache.warm() == 2 and touched[-1] == [12, 13]
    cache.check()


def test_a_device_pool_is_not_warmed():
    """A pool whose memory is committed when allocated (``lazy`` False: CUDA) has nothing to
    make resident."""
    pool = NumpyPrefixPool(CFG, 8, BT)
    pool.lazy = False
    cache = PrefixCache(pool)
    assert not cache.warm_pending and cache.warm() == 0


def test_blocks_on_probation_go_first_and_a_use_takes_them_off():
    """A Score's blocks (``insert(..., probation=True)``) are evicted before any other while
    nobody took them: one-off Score sequences push out each other, not a chat's history;
    taken by a request (a match), or made again by a generation, they are ordinary blocks."""
    cache, kv = new_cache(6), KVBuffers(CFG, 1)
    chat = list(range(33))  # 2 whole blocks and 1 row: 3 blocks
    serve(cache, kv, chat)

    def score(tokens):  # a Score sequence kept (its rows, on probation)
        kv.clear(0)
        prefill(kv, 0, tokens)
        cache.insert_many(kv, [(0, tokens)], probation=True)

    for k in range(5):  # one-off Score sequences of 2 whole blocks each: 3 free blocks
        score(list(range(1000 * (k + 1), 1000 * (k + 1) + 32)))
        cache.check()
        assert cache.cached_tokens(chat) == 32  # the chat's blocks stay
    reused = list(range(5000, 5032))  # the last one kept: taken now, so off probation
    blocks, n = cache.match(reused + [1])
    cache.release(blocks)
    assert n == 32
    for k in range(3):
        score(list(range(100 * k, 100 * k + 16)) + [7] * 16)
    assert cache.cached_tokens(reused + [1]) == 32 and cache.cached_tokens(chat) >= 16
    # a generation making a kept block's rows again takes it off probation too
    again = list(range(9000, 9032))
    score(again)
    keys = [block_key(b"", again[:16])]
    keys.append(block_key(keys[0], again[16:]))
    assert all(cache._blocks[cache._by_key[k]].probation for k in keys)
    kv.clear(0)
    prefill(kv, 0, again + [3])  # (no match first: the generation computes the rows again)
    cache.insert(kv, 0, again + [3])
    assert not any(cache._blocks[cache._by_key[k]].probation for k in keys)
    cache.check()

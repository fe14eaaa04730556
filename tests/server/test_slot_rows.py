"""``server.slot_rows``: the tokens of the rows a free slot kept, matched against a new prompt
(over the fake runner's cache; the rows themselves, on both real runners, are tested in
tests/artifact/test_kv_cache.py and through the engine in tests/server/test_speedups.py)."""
from __future__ import annotations

import random

from fake_lm import FakeCache

from kvserve.server.slot_rows import SlotRows, common_prefix


def _reference(a, b, limit):
    n = 0
    while n < min(len(a), len(b), limit) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix_equals_a_token_by_token_scan():
    rnd = random.Random(0)
    for _ in range(5000):
        a = [rnd.randrange(3) for _ in range(rnd.randrange(0, 300))]
        b = a[:rnd.randrange(0, len(a) + 1)] + [rnd.randrange(3)
                                                for _ in range(rnd.randrange(0, 200))]
        limit = rnd.randrange(-2, 400)
        assert common_prefix(a, b, limit) == _reference(a, b, limit), (a, b, limit)


def test_a_slot_offers_the_rows_it_kept_and_nothing_once_they_are_gone():
    kv, rows = FakeCache(2), SlotRows()
    kv.used[1] = 30  # slot 1's sequence leaves with 30 rows (its 31st token never fed)
    rows.left(kv, 1, list(range(31)))
    kv.used[1] = 0
    assert kv.retained[1] == 30
    assert rows.match(kv, 1, list(range(40))) == 30
    assert rows.match(kv, 1, list(range(20))) == 19  # one token left to prefill
    assert rows.match(kv, 1, list(range(12)) + [99] * 20) == 12
    assert rows.match(kv, 0, list(range(40))) == 0  # another slot
    rows.take(kv, 1, 25)
    assert kv.used[1] == 25 and kv.retained[1] == 0
    assert rows.match(kv, 1, list(range(40))) == 0  # taken: the slot is in use
    kv.used[0] = 10
    rows.left(kv, 0, list(range(11)))
    kv.move(1, 0)  # compaction overwrites slot 0: its kept rows are gone
    assert rows.match(kv, 0, list(range(40))) == 0
    kv.used[1] = 5
    rows.left(kv, 1, None)  # rows whose tokens are not all known: nothing kept
    assert kv.retained[1] == 0 and rows.match(kv, 1, list(range(40))) == 0

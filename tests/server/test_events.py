"""server/events.py: the engine hands events over without waking the caller, and wakes it at
most once per stream interval (first token and end at once); nothing is lost or reordered."""
from __future__ import annotations

import queue
import threading
import time

import pytest
from fake_lm import FakeLM
from test_engine_fake import _collect, _req, _token_bytes

from kvserve.server.domain import FinishEvent, TokenEvent
from kvserve.server.engine import Engine
from kvserve.server.events import EventChannel


def test_channel_get_put_stage_wake():
    ch = EventChannel()
    with pytest.raises(queue.Empty):
        ch.get_nowait()
    with pytest.raises(queue.Empty):
        ch.get(timeout=0.01)
    ch.stage(1)
    assert ch.get_nowait() == 1  # staged events are there for a caller that looks
    ch.put(2)
    assert ch.get(timeout=1) == 2 and ch.empty()


def test_a_blocked_caller_sleeps_through_stage_and_wakes_on_wake():
    ch = EventChannel()
    got, t = [], {}

    def consumer():
        got.append(ch.get(timeout=5))
        t["woke"] = time.monotonic()

    th = threading.Thread(target=consumer)
    th.start()
    # until the consumer waits on the channel's Event (CPython's Event keeps a Condition
    # whose waiters are listed), not a fixed sleep: a late-starting thread would find "a"
    end = time.monotonic() + 5
    while not ch._ready._cond._waiters and time.monotonic() < end:
        time.sleep(0.001)
    assert ch._ready._cond._waiters, "the consumer never blocked"
    ch.stage("a")
    time.sleep(0.1)
    woke_at = time.monotonic()
    ch.wake()
    th.join(5)
    assert got == ["a"]
    assert t["woke"] >= woke_at  # blocked since before the stage: only wake() woke it


def test_no_event_is_lost_between_producer_and_consumer():
    ch, n = EventChannel(), 20_000
    out: list[int] = []

    def consumer():
        while len(out) < n:
            out.append(ch.get(timeout=5))

    th = threading.Thread(target=consumer)
    th.start()
    for i in range(n):
        (ch.put if i % 7 == 0 else ch.stage)(i)
        if i % 50 == 49:
            ch.wake()
    ch.wake()
    th.join(10)
    assert out == list(range(n))


class _Counting(EventChannel):
    """Counts the wake-ups the engine gives one caller."""
    __slots__ = ("wakes",)

    def __init__(self):
        super().__init__()
        self.wakes = 0

    def wake(self):
        self.wakes += 1
        super().wake()


@pytest.mark.parametrize("interval", [0.0, 0.05])
def test_engine_wakes_a_caller_at_most_once_per_interval(interval):
    lm = FakeLM(64, step_delay=0.002)  # ~25 steps per 50 ms interval
    engine = Engine(lm, _token_bytes(), max_batch=2, max_queue=4, score_chunk_floats=64 * 64,
                    eos_id=None, stream_interval=interval)
    engine.start()
    try:
        box = _Counting()
        t0 = time.monotonic()
        h = engine.submit(_req([3], 60), events=box)
        first = box.get(timeout=5)
        assert isinstance(first, TokenEvent) and first.index == 0
        assert time.monotonic() - t0 < 1.0  # the first token is not held back
        toks, fin = _collect(h)
        toks = [first.token_id] + toks
        assert toks == lm.reference([3], 60) and isinstance(fin, FinishEvent)
        seconds = time.monotonic() - t0
        if interval:
            # first token, end, and at most one per interval in between
            assert box.wakes <= 2 + seconds / interval + 1, (box.wakes, seconds)
        else:
            assert box.wakes == 61  # every token and the end
    finally:
        engine.stop()


@pytest.mark.parametrize("scaled", [False, True])
def test_many_streaming_callers_share_the_wake_ups(scaled):
    """N callers streaming together are woken every N intervals (up to the maximum), so the
    engine's wake-ups per second stay ~1 / interval in all; with the maximum at the interval
    each is woken every interval, as one alone."""
    interval, n = 0.01, 4
    lm = FakeLM(64, step_delay=0.003)
    engine = Engine(lm, _token_bytes(), max_batch=n, max_queue=8, score_chunk_floats=64 * 64,
                    eos_id=None, stream_interval=interval,
                    stream_interval_max=1.0 if scaled else interval)
    engine.start()
    try:
        boxes = [_Counting() for _ in range(n)]
        t0 = time.monotonic()
        # admitted in one round (submitted one by one, a pause between two submissions would
        # add admission rounds, each a wake-up, that the bound below does not count)
        handles = engine.submit_many([_req([3 + i], 100) for i in range(n)], events=boxes)
        for i, h in enumerate(handles):
            toks, fin = _collect(h)
            assert len(toks) == 100 and isinstance(fin, FinishEvent)
        seconds = time.monotonic() - t0
        wakes = max(b.wakes for b in boxes)
        if scaled:  # first token, end, one per n intervals
            assert wakes <= 4 + seconds / (n * interval), (wakes, seconds)
        else:
            assert wakes > 4 + seconds / (n * interval), (wakes, seconds)
            assert wakes <= 4 + seconds / interval, (wakes, seconds)
    finally:
        engine.stop()


def test_gauges_follow_a_failed_iteration_and_the_end():
    """A decode step that raises fails the sequences in flight (ERROR) and the running gauge
    drops to 0; at shutdown the queue gauge does too."""
    class Gauges:
        def __init__(self):
            self.running_values, self.queue_values = [], []

        def queue_depth(self, n): self.queue_values.append(n)
        def running(self, n): self.running_values.append(n)
        def admitted(self, *a): ...
        def token(self, *a): ...
        def finished(self, *a): ...
        def step(self, *a): ...

    class Failing(FakeLM):
        def decode(self, cache, n, tokens, attention=False):
            if self.calls["decode"] == 3:
                self.calls["decode"] += 1
                raise RuntimeError("boom")
            return super().decode(cache, n, tokens, attention)

    g = Gauges()
    engine = Engine(Failing(64), _token_bytes(), max_batch=2, max_queue=4,
                    score_chunk_floats=64 * 64, eos_id=None, metrics=g, stream_interval=0.05)
    engine.start()
    try:
        _, fin = _collect(engine.submit(_req([3], 50)))
        assert fin.reason.value == "error" and fin.error == "internal error"
        assert 1 in g.running_values and g.running_values[-1] == 0
    finally:
        engine.stop()
    assert g.queue_values[-1] == 0


def test_a_sink_with_put_alone_gets_every_event():
    """A caller's own sink without stage / wake is handed each event at once (put)."""
    class PutOnly:
        def __init__(self):
            self.events, self.done = [], threading.Event()

        def put(self, ev):
            self.events.append(ev)
            if isinstance(ev, FinishEvent):
                self.done.set()

    lm = FakeLM(64)
    engine = Engine(lm, _token_bytes(), max_batch=2, max_queue=4, score_chunk_floats=64 * 64,
                    eos_id=None, stream_interval=0.05)
    engine.start()
    try:
        sink = PutOnly()
        engine.submit(_req([3], 20), events=sink)
        assert sink.done.wait(5)
        assert [e.token_id for e in sink.events[:-1]] == lm.reference([3], 20)
    finally:
        engine.stop()

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


class _Watched(EventChannel):
    """An EventChannel that says when its consumer found it empty and is about to block (the
    only path that clears its Event), and keeps count of what was handed over."""
    __slots__ = ("blocking", "staged", "wakes", "staged_at_wake")

    def __init__(self):
        super().__init__()
        self.blocking = threading.Event()
        self.staged, self.wakes, self.staged_at_wake = 0, 0, []

    def stage(self, ev) -> None:
        self.staged += 1
        super().stage(ev)

    def put(self, ev) -> None:
        self.staged += 1
        super().put(ev)  # (EventChannel.put appends and calls self.wake)

    def wake(self) -> None:
        self.wakes += 1
        self.staged_at_wake.append(self.staged)
        super().wake()

    def get(self, block: bool = True, timeout: float | None = None):
        if block and super().empty():
            self.blocking.set()
        return super().get(block, timeout)


def test_a_blocked_caller_sleeps_through_stage_and_wakes_on_wake():
    ch = _Watched()
    got = []

    def consumer():
        got.append(ch.get(timeout=60))

    th = threading.Thread(target=consumer)
    th.start()
    # the consumer found the channel empty and is (about to be) blocked: whether it blocks
    # before or after the stage below, only a wake can release it (stage sets no Event)
    assert ch.blocking.wait(60), "the consumer never blocked"
    ch.stage("a")
    th.join(0.05)  # (a chance for a wrong wake-up to show; the checks below are on state)
    assert th.is_alive() and got == [], "stage woke the consumer"
    ch.wake()
    th.join(60)
    assert got == ["a"]


def test_no_event_is_lost_between_producer_and_consumer():
    ch, n = EventChannel(), 20_000
    out: list[int] = []

    def consumer():
        while len(out) < n:
            out.append(ch.get(timeout=60))

    th = threading.Thread(target=consumer)
    th.start()
    for i in range(n):
        (ch.put if i % 7 == 0 else ch.stage)(i)
        if i % 50 == 49:
            ch.wake()
    ch.wake()
    th.join(120)  # (returns as soon as the consumer has all: a deadline, not a duration)
    assert out == list(range(n))


_Counting = _Watched  # counts the wake-ups the engine gives one caller


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
        first = box.get(timeout=60)
        assert isinstance(first, TokenEvent) and first.index == 0
        # the first token is not held back: the first wake-up came with the first event
        assert box.staged_at_wake[0] == 1, box.staged_at_wake[:5]
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
        else:  # more than scaled would give; on a machine so slow that each step outlasts
            # the interval, every token wakes its caller (100 wake-ups; the bound: 100 / n)
            assert wakes > 4 + min(seconds / (n * interval), 100 / n), (wakes, seconds)
            assert wakes <= 4 + seconds / interval, (wakes, seconds)
    finally:
        engine.stop()


def test_gauges_follow_failed_iterations_and_the_end():
    """A decode step that raises restarts the sequence in flight (tests/server/test_restart.py),
    a second one fails it (ERROR); the running gauge drops to 0 at each and the failures are
    counted; at shutdown the queue gauge drops to 0 too."""
    class Gauges:
        def __init__(self):
            self.running_values, self.queue_values, self.failed = [], [], []

        def queue_depth(self, n): self.queue_values.append(n)
        def running(self, n): self.running_values.append(n)
        def admitted(self, *a): ...
        def token(self, *a): ...
        def finished(self, *a): ...
        def step(self, *a): ...
        def iteration_failed(self, n): self.failed.append(n)

    class Failing(FakeLM):
        def decode(self, cache, n, tokens, attention=False):
            if self.calls["decode"] in (3, 6):
                self.calls["decode"] += 1
                raise RuntimeError("boom")
            return super().decode(cache, n, tokens, attention)

    g = Gauges()
    engine = Engine(Failing(64), _token_bytes(), max_batch=2, max_queue=4,
                    score_chunk_floats=64 * 64, eos_id=None, metrics=g, stream_interval=0.05)
    engine.start()
    try:
        toks, fin = _collect(engine.submit(_req([3], 50)))
        assert fin.reason.value == "error" and fin.error == "internal error"
        assert g.failed == [1, 0]  # restarted at the first, failed at the second
        assert len(toks) >= 4  # its tokens before each failure (one a step)
        assert 1 in g.running_values and g.running_values[-1] == 0
        assert g.running_values.count(0) >= 2
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


def test_is_staged_sink_agrees_with_the_protocol_check():
    from kvserve.server.interfaces import StagedSink, is_staged_sink

    class PutOnly:
        def put(self, ev): ...

    class NotCallable:
        put = stage = wake = None

    for sink in (EventChannel(), queue.SimpleQueue(), PutOnly(), NotCallable(), object()):
        assert is_staged_sink(sink) == isinstance(sink, StagedSink), sink
    assert is_staged_sink(EventChannel()) and not is_staged_sink(queue.SimpleQueue())

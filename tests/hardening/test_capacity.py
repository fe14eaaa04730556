"""Overload, cancellation and deadlines, observed from outside: status codes, timings and the
Prometheus endpoint (scraped over HTTP on loopback).

The tiny model decodes 240 tokens in ~50 ms, faster than a client can act on a stream; these
tests slow every decode step down (``slow_decode``: a sleep before each runner decode step) so that a
generation reliably outlasts the actions under test on any machine.
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from hardening_helpers import (collect, gen_request, held_decode, outcome, running_app, scrape,
                               slow_decode, wait_for)

from kvserve.server import engine as engine_mod
from kvserve.v1 import inference_pb2_grpc as pb_grpc

N, Q = 2, 2  # max_batch, max_queue of the small server
STEP = 0.01  # seconds per decode step (slowed down)
LONG = 200  # tokens: 2 s at least per generation, longer than the steps that set a test up


@pytest.fixture(scope="module")
def small(artifact):
    with running_app(artifact, max_batch=N, max_queue=Q, metrics_port=0) as app:
        ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
        grpc.channel_ready_future(ch).result(timeout=10)
        yield app, pb_grpc.InferenceStub(ch)
        ch.close()


def running(app) -> float:
    return scrape(app.metrics_server.port)["kvserve_running_sequences"]


def queued(app) -> float:
    return scrape(app.metrics_server.port)["kvserve_queue_size"]


def test_overload_is_immediate_and_capacity_comes_back(small, monkeypatch):
    """max_batch N decoding and max_queue Q waiting: call N+Q+1 is RESOURCE_EXHAUSTED while the
    model is held (no decode step runs once N sequences are in the batch: the refusal waits for
    no capacity to free); the N+Q in flight all complete; a call once capacity frees succeeds."""
    app, stub = small
    go = held_decode(monkeypatch, app, lambda: len(app.engine.active) >= N, STEP)
    try:
        # (the engine's own counts: the gauges are updated after the step that is held)
        calls = [stub.Generate(gen_request("x", LONG)) for _ in range(N)]
        assert wait_for(lambda: app.engine.load()["running"] == N, 30)
        calls += [stub.Generate(gen_request("x", LONG)) for _ in range(Q)]
        full = {"running": N, "queued": Q, "score_jobs": 0}
        assert wait_for(lambda: app.engine.load() == full, 30)
        steps = app.engine.steps
        with pytest.raises(grpc.RpcError) as e:
            collect(stub.Generate(gen_request("z", 2), timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "capacity" in e.value.details() and "retry" in e.value.details()
        # refused with every slot still busy and no step taken: nothing was waited for
        assert app.engine.steps == steps and app.engine.load() == full
        assert outcome(scrape(app.metrics_server.port), "QueueFull") >= 1
    finally:
        go.set()

    # A slot frees: a call sent the moment a stream ends is accepted, even while the engine
    # has not yet compacted its batch (held here for 0.3 s after a sequence finishes, as a busy
    # machine may hold it; before the fix this answered RESOURCE_EXHAUSTED).
    retire = app.engine.sched.retire_done

    def slow_retire():
        if any(s.done for s in app.engine.active):
            time.sleep(0.3)
        retire()

    monkeypatch.setattr(app.engine.sched, "retire_done", slow_retire)
    chunks, done = collect(calls[0])
    assert done.generated_tokens == len(chunks) == LONG
    _, done = collect(stub.Generate(gen_request("z", 2), timeout=30))
    assert done.generated_tokens == 2
    for c in calls[1:]:
        chunks, done = collect(c)
        assert done.generated_tokens == len(chunks) == LONG
    assert wait_for(lambda: running(app) == 0 and queued(app) == 0, 30)


def test_cancel_mid_stream_frees_the_slot_within_one_decode_step(hsrv, monkeypatch):
    app = hsrv.app
    slow_decode(monkeypatch, app, STEP)  # (one token a step: the 200 must not all fit before
    # the cancellation lands)
    at_cancel = []
    orig = engine_mod.Handle.cancel

    def cancel(self):  # the server learns of the cancellation here (context callback)
        if not self.cancelled:
            at_cancel.append(app.engine.steps)
        orig(self)

    monkeypatch.setattr(engine_mod.Handle, "cancel", cancel)
    port = app.metrics_server.port
    before = scrape(port)
    call = hsrv.stub.Generate(gen_request("x", 200))
    next(call), next(call)
    assert wait_for(lambda: running(app) == 1, 30)
    call.cancel()
    assert wait_for(lambda: running(app) == 0, 30), "the slot was not freed"
    assert len(at_cancel) == 1
    # the step that was running when the cancellation arrived may finish; no other starts
    assert app.engine.steps - at_cancel[0] <= 1
    after = scrape(port)
    assert outcome(after, "cancelled") == outcome(before, "cancelled") + 1
    generated = after["kvserve_generated_tokens_total"] - before["kvserve_generated_tokens_total"]
    assert 2 <= generated < 200
    time.sleep(5 * STEP)
    assert scrape(port)["kvserve_generated_tokens_total"] == after[
        "kvserve_generated_tokens_total"]
    with pytest.raises(grpc.RpcError) as e:
        collect(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert hsrv.healthy()


def test_cancelled_queued_request_never_runs(small, monkeypatch):
    """The slots are busy; a queued request is cancelled: it leaves the queue, is never
    admitted (no prompt tokens, no queue-time sample, no generated token) and counts as
    cancelled."""
    app, stub = small
    slow_decode(monkeypatch, app, STEP)
    port = app.metrics_server.port
    before = scrape(port)
    busy = [stub.Generate(gen_request([7] * 3, 40)) for _ in range(N)]
    assert wait_for(lambda: running(app) == N, 30)
    victim = stub.Generate(gen_request([9] * 11, 40))  # 11 prompt tokens: easy to tell apart
    assert wait_for(lambda: queued(app) == 1, 30)
    victim.cancel()
    assert wait_for(lambda: queued(app) == 0, 30)
    assert running(app) == N
    for c in busy:
        assert collect(c)[1].generated_tokens == 40
    after = scrape(port)
    d = {k: after[k] - before.get(k, 0.0) for k in (
        "kvserve_prompt_tokens_total", "kvserve_generated_tokens_total",
        "kvserve_queue_time_seconds_count")}
    assert d == {"kvserve_prompt_tokens_total": 3 * N, "kvserve_generated_tokens_total": 40 * N,
                 "kvserve_queue_time_seconds_count": N}
    assert outcome(after, "cancelled") == outcome(before, "cancelled") + 1
    with pytest.raises(grpc.RpcError) as e:
        collect(victim)
    assert e.value.code() == grpc.StatusCode.CANCELLED


def test_deadline_200ms_on_a_long_generation_stops_the_work(hsrv, monkeypatch):
    app = hsrv.app
    slow_decode(monkeypatch, app, STEP)  # 200 tokens would take >= 2 s (one token a step)
    port = app.metrics_server.port
    before = scrape(port)
    with pytest.raises(grpc.RpcError) as e:
        collect(hsrv.stub.Generate(gen_request("x", 200), timeout=0.2))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # the engine stops decoding it: the running gauge goes back to 0 long before the 200
    # tokens could have been made (the generated count below) ...
    assert wait_for(lambda: running(app) == 0, 30)
    after = scrape(port)
    generated = after["kvserve_generated_tokens_total"] - before["kvserve_generated_tokens_total"]
    assert generated < 100, generated
    # ... and no step runs after that
    steps = app.engine.steps
    time.sleep(10 * STEP)
    assert app.engine.steps == steps
    ended = (outcome(after, "time_limit") + outcome(after, "cancelled")
             - outcome(before, "time_limit") - outcome(before, "cancelled"))
    assert ended == 1
    assert hsrv.healthy()


def test_many_cancels_and_deadlines_leave_no_running_sequence(hsrv, monkeypatch):
    """Concurrent streams cut at random points (cancel, short deadline, read to the end): the
    server ends with nothing running or queued and stays healthy."""
    app = hsrv.app
    slow_decode(monkeypatch, app, 0.002)
    errors = []

    def one(i):
        try:
            if i % 3 == 0:
                call = hsrv.stub.Generate(gen_request("x", 100))
                next(call)
                call.cancel()
            elif i % 3 == 1:
                collect(hsrv.stub.Generate(gen_request("x", 100), timeout=0.05 + 0.01 * i))
            else:
                collect(hsrv.stub.Generate(gen_request("x", 10)))
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                errors.append(e)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(18)]  # < capacity 20
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert wait_for(lambda: app.engine.load() == {"running": 0, "queued": 0, "score_jobs": 0},
                    30)
    assert running(app) == 0 and queued(app) == 0
    assert hsrv.healthy()

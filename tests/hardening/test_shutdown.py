"""SIGTERM during active streams, on a real ``kvserve serve`` subprocess (through slow_serve.py:
every decode step sleeps a little first, so that generations outlast what the test does).

Within the grace: health turns NOT_SERVING, new calls are UNAVAILABLE, every stream in flight
(decoding or queued) finishes normally, exit code 0.
Past the grace: what is still in flight ends with UNAVAILABLE and a message that says the server
is shutting down (not gRPC's bare "Cancelling all calls"), and the exit code is still 0.
"""
from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from hardening_helpers import (NOT_SERVING, SERVING, collect, gen_request, health, scrape,
                               served, wait_for)

from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc


def _run_all(calls):
    """Collect each stream in its own thread: [(chunks, complete) or RpcError]."""
    out = [None] * len(calls)

    def run(i):
        try:
            out[i] = collect(calls[i])
        except grpc.RpcError as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    return threads, out


def _loaded(s, running, queued):
    m = scrape(s.metrics_port)
    return m["kvserve_running_sequences"] == running and m["kvserve_queue_size"] == queued


def test_sigterm_within_grace_drains_then_exits_0(artifact, tmp_path):
    with served(artifact.dir, tmp_path, "--drain-grace", "30", "--max-batch", "2",
                "--metrics-port", "0", "--speculative-tokens", "0",  # one token a step
                step_delay=0.01) as s:
        stub = pb_grpc.InferenceStub(s.channel)
        calls = [stub.Generate(gen_request("x", 60)) for _ in range(4)]  # 2 decoding, 2 queued
        threads, out = _run_all(calls)
        assert wait_for(lambda: _loaded(s, 2, 2), 10)
        assert health(s.channel) == SERVING
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: health(s.channel) == NOT_SERVING, 2)
        assert health(s.channel, "kvserve.v1.Inference") == NOT_SERVING
        for new in (lambda: collect(stub.Generate(gen_request("y", 2), timeout=5)),
                    lambda: stub.Score(pb.ScoreRequest(texts=["ab"]), timeout=5),
                    lambda: stub.Tokenize(pb.TokenizeRequest(texts=["a"]), timeout=5)):
            with pytest.raises(grpc.RpcError) as e:
                new()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in e.value.details()
        for t in threads:
            t.join(30)
        for r in out:
            assert not isinstance(r, Exception), r
            chunks, done = r
            assert done.finish_reason == pb.FINISH_REASON_LENGTH
            assert done.generated_tokens == len(chunks) == 60
        assert s.proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 30
        log = s.log()
        assert "received SIGTERM" in log and "'queued': 2" in log


def test_sigterm_past_grace_ends_streams_with_unavailable_shutting_down(artifact, tmp_path):
    grace = 0.3
    with served(artifact.dir, tmp_path, "--drain-grace", grace, "--max-batch", "2",
                "--metrics-port", "0", "--speculative-tokens", "0",  # one token a step
                step_delay=0.01) as s:
        stub = pb_grpc.InferenceStub(s.channel)
        calls = [stub.Generate(gen_request("x", 250)) for _ in range(4)]  # >= 2.5 s each
        threads, out = _run_all(calls)
        assert wait_for(lambda: _loaded(s, 2, 2), 10)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        ended = time.monotonic() - t0
        for r in out:  # the decoding ones and the queued ones alike
            assert isinstance(r, grpc.RpcError), r
            assert r.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in r.details() and "retry" in r.details(), r.details()
        assert grace <= ended < grace + 2.0, ended
        assert s.proc.wait(timeout=10) == 0

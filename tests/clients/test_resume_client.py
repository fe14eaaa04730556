"""The client resumes a started Generate stream (clients/resume.py) against scripted servicers
on a real gRPC server: the caller sees one stream (every index once, in order) across cuts
with UNAVAILABLE, RESOURCE_EXHAUSTED and a proxy's INTERNAL "Stream removed" (before the
first token too); each attempt carries the delivered ids and the same seed (chosen by the
client for an unseeded sampled request); other errors, ``resume=False`` and a stream that does
not continue are raised. The real server's side is tests/server/test_resume*.py; both together behind nginx:
tests/deploy/test_failover.py."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from kvserve.clients import AsyncClient, Client, KvserveError, RetryPolicy, TokenEvent
from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc

FAST = dict(initial_backoff=0.01, max_backoff=0.05)
N = 12
UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, "the server is draining")
RESET = (grpc.StatusCode.INTERNAL, "Stream removed (RST_STREAM with error code 2)")
BUSY = (grpc.StatusCode.RESOURCE_EXHAUSTED, "at capacity")


class Cuts(pb_grpc.InferenceServicer):
    """Generate: token ``index`` has id 100 + index, from index len(resume.token_ids) on;
    call k (0-based) ends after ``cuts[k] = (tokens, (code, details))`` of them, the calls
    after the listed ones complete. ``restart``: ignore resume (an older server: from 0)."""

    def __init__(self, cuts, restart=False, wrong=False):
        self.cuts, self.restart, self.wrong = list(cuts), restart, wrong
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request, context):  # noqa: N802
        k = len(self.requests)
        self.requests.append(request)
        start = 0 if self.restart else len(request.resume.token_ids)
        stop, status = self.cuts[k] if k < len(self.cuts) else (N, None)
        for i in range(start, min(N, start + stop) if status else N):
            tid = 100 + i + (1 if self.wrong and k and i < start + 1 else 0)
            yield pb.GenerateResponse(chunk=pb.TokenChunk(index=i, id=tid, text=f"t{i} "))
        if status:
            context.abort(*status)
        yield pb.GenerateResponse(complete=pb.Complete(
            finish_reason=pb.FINISH_REASON_LENGTH, generated_tokens=N,
            text="".join(f"t{i} " for i in range(N))))


def _sync(target, **kw):
    with Client(target, retry=kw.pop("retry", RetryPolicy(max_attempts=3, **FAST))) as c:
        return list(c.generate_stream("x", **kw))


def _async(target, **kw):
    async def go():
        async with AsyncClient(target, retry=kw.pop("retry", RetryPolicy(max_attempts=3,
                                                                          **FAST))) as c:
            return [ev async for ev in c.generate_stream("x", **kw)]
    return asyncio.run(go())


@pytest.mark.parametrize("run", [_sync, _async], ids=["sync", "async"])
def test_one_stream_across_cuts(scripted, run):
    svc = Cuts([(0, RESET), (3, UNAVAILABLE), (4, RESET), (1, BUSY)])
    evs = run(scripted(svc), temperature=0.7)
    toks = [e for e in evs if isinstance(e, TokenEvent)]
    assert [e.index for e in toks] == list(range(N))
    assert [e.id for e in toks] == [100 + i for i in range(N)]
    assert evs[-1].type == "complete" and evs[-1].generated_tokens == N
    assert [list(r.resume.token_ids) for r in svc.requests] == [
        [], [], [100, 101, 102], [100 + i for i in range(7)], [100 + i for i in range(8)]]
    assert all(r.HasField("resume") for r in svc.requests)  # "this client resumes"
    seeds = {r.sampling.seed for r in svc.requests}  # chosen once, kept for every attempt
    assert all(r.sampling.HasField("seed") for r in svc.requests) and len(seeds) == 1


def test_seeds_only_where_needed(scripted):
    svc = Cuts([])
    _sync(scripted(svc))  # greedy: no seed needed
    _sync(scripted(svc), temperature=0.7, seed=42)  # the caller's seed is kept
    _sync(scripted(svc), temperature=0.7, resume=False)  # not resuming: left unseeded
    assert [r.sampling.HasField("seed") for r in svc.requests] == [False, True, False]
    assert svc.requests[1].sampling.seed == 42 and not svc.requests[2].HasField("resume")


@pytest.mark.parametrize("run", [_sync, _async], ids=["sync", "async"])
def test_what_is_not_resumed_is_raised(scripted, run):
    stop = [(3, UNAVAILABLE)]
    for cuts, kw, code, calls in [
            ([(3, (grpc.StatusCode.INTERNAL, "generation failed (internal error)"))], {},
             grpc.StatusCode.INTERNAL, 1),
            ([(3, (grpc.StatusCode.INVALID_ARGUMENT, "bad"))], {},
             grpc.StatusCode.INVALID_ARGUMENT, 1),
            (stop, {"resume": False}, grpc.StatusCode.UNAVAILABLE, 1),
            # after progress, 3 attempts without any: the policy's bound
            (stop + [(0, UNAVAILABLE)] * 3, {}, grpc.StatusCode.UNAVAILABLE, 3)]:
        svc = Cuts(cuts)
        with pytest.raises(KvserveError) as e:
            run(scripted(svc), **kw)
        assert (e.value.code, len(svc.requests)) == (code, calls), (cuts, kw)


@pytest.mark.parametrize("run", [_sync, _async], ids=["sync", "async"])
def test_a_resumed_stream_that_reaches_a_stopping_server_goes_on(scripted, run):
    """A drain moves a stream (UNAVAILABLE); its resumed call reaches, through a balancer, the
    draining server as it stops, which gRPC ends CANCELLED: resumed again, elsewhere. Without
    resuming, a started stream's CANCELLED is raised."""
    cancelled = (grpc.StatusCode.CANCELLED, "CANCELLED")
    svc = Cuts([(5, UNAVAILABLE), (0, cancelled)])
    evs = run(scripted(svc))
    assert [e.index for e in evs if isinstance(e, TokenEvent)] == list(range(N))
    assert len(svc.requests) == 3
    with pytest.raises(KvserveError) as e:
        run(scripted(Cuts([(5, cancelled)])), resume=False)
    assert e.value.code is grpc.StatusCode.CANCELLED


def test_the_budget_restarts_after_progress(scripted):
    """Five cuts, each after one new token, with 2 attempts per failure: it completes."""
    svc = Cuts([(1, UNAVAILABLE)] * 5)
    evs = _sync(scripted(svc), retry=RetryPolicy(max_attempts=2, **FAST))
    assert [e.index for e in evs if isinstance(e, TokenEvent)] == list(range(N))


def test_a_restarted_stream_is_checked_and_skipped(scripted):
    """A server that ignores resume (sends from index 0 again): the tokens already delivered
    are skipped when they are the same, and refused (DATA_LOSS) when not."""
    evs = _sync(scripted(Cuts([(5, RESET)], restart=True)))
    assert [e.index for e in evs if isinstance(e, TokenEvent)] == list(range(N))
    with pytest.raises(KvserveError) as e:
        _sync(scripted(Cuts([(5, RESET)], restart=True, wrong=True)))
    assert e.value.code is grpc.StatusCode.DATA_LOSS and "does not continue" in e.value.details


class Slow(pb_grpc.InferenceServicer):
    """Generate: 200 tokens, 10 ms apart (a stream still running when its caller stops it)."""

    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        for i in range(len(request.resume.token_ids), 200):
            if not context.is_active():
                return
            yield pb.GenerateResponse(chunk=pb.TokenChunk(index=i, id=100 + i, text="t"))
            time.sleep(0.01)


def test_a_stream_its_caller_cancels_ends_without_a_resume(scripted):
    """A call cancelled through ``on_call`` (``kvserve chat``'s Ctrl-C, from another thread)
    ends the stream with CANCELLED: it is not taken for a server's cancellation and resumed,
    which would have the server generate the whole answer again, unseen, while the caller
    waits for its end."""
    svc, calls, got = Slow(), [], []
    target = scripted(svc)

    def cancel_soon():
        while not got:
            time.sleep(0.001)
        calls[-1].cancel()
    threading.Thread(target=cancel_soon, daemon=True).start()
    t0 = time.monotonic()
    with Client(target, retry=RetryPolicy(max_attempts=3, **FAST)) as c:
        with pytest.raises(KvserveError) as e:
            for ev in c.generate_stream("x", on_call=calls.append, temperature=0.7):
                got.append(ev)
    assert e.value.code is grpc.StatusCode.CANCELLED
    assert len(svc.requests) == len(calls) == 1 and len(got) < 200
    assert time.monotonic() - t0 < 1.5  # (200 tokens would take 2 s)

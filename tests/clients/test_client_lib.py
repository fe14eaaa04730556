"""The Python client: typed results, async parity, retries (which codes, how many attempts, never
after streamed tokens unless resuming: tests/clients/test_resume_client.py), against real
servers on loopback."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent import futures

import grpc
import pytest

from client_helpers import free_port, running_app
from kvserve.clients import AsyncClient, Client, KvserveError, RetryPolicy, TokenEvent
from kvserve.clients.client import Completion
from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc

FAST = dict(initial_backoff=0.05, max_backoff=0.3)


class Attempts:
    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def __call__(self, method: str, attempt: int) -> None:
        self.calls.append((method, attempt))

    def count(self, method: str) -> int:
        return sum(m == method for m, _ in self.calls)


def test_generate_typed_events(target, artifact):
    with Client(target) as c:
        events = list(c.generate_stream("class Point:\n", max_new_tokens=8, ignore_eos=True,
                                        top_logprobs=2))
        info = c.model_info()
    *tokens, done = events
    assert all(isinstance(t, TokenEvent) for t in tokens) and isinstance(done, Completion)
    assert [t.index for t in tokens] == list(range(8))
    assert all(t.logprob is not None and len(t.top_logprobs) == 2 for t in tokens)
    assert done.finish_reason == "length" and done.generated_tokens == 8
    assert done.prompt_tokens == len(artifact.tokenizer.encode("class Point:\n"))
    assert done.text == "".join(t.text for t in tokens)
    assert 0 <= done.timings.time_to_first_token_seconds <= done.timings.total_seconds
    assert info.vocab_size == artifact.cfg.vocab_size and info.attention_available
    prompt = "def cached(a, b):\n    return a + b\n" * 3  # whole blocks for the prefix cache
    with Client(target) as c:
        first = c.generate(prompt, max_new_tokens=2)
        again = c.generate(prompt, max_new_tokens=2)
    assert first.cached_prompt_tokens == 0 < again.cached_prompt_tokens < again.prompt_tokens
    assert info.limits["max_score_sequences"] >= 1


def test_async_client_matches_sync(target):
    texts = ["def add(a, b):", "naïve café"]

    async def go():
        async with AsyncClient(target) as c:
            comp = await c.generate("def add(a, b):", max_new_tokens=6, ignore_eos=True)
            scores = await c.score(texts)
            ids = await c.tokenize(texts)
            back = await c.detokenize(ids)
            return comp, scores, back

    comp, scores, back = asyncio.run(go())
    with Client(target) as c:
        ref = c.generate("def add(a, b):", max_new_tokens=6, ignore_eos=True)
        ref_scores = c.score(texts)
    assert [t.id for t in comp.tokens] == [t.id for t in ref.tokens]
    assert back == texts
    for a, b in zip(scores, ref_scores):
        assert a.logprobs == b.logprobs and a.sum_logprob == b.sum_logprob


def test_invalid_argument_is_not_retried(target):
    hook = Attempts()
    with Client(target, on_attempt=hook, retry=RetryPolicy(max_attempts=5, **FAST)) as c:
        with pytest.raises(KvserveError) as ei:
            c.score(["x"], top_logprobs=10_000)
        with pytest.raises(KvserveError) as eg:
            list(c.generate_stream("x", temperature=-1))
    assert ei.value.code is grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in ei.value.details
    assert eg.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert hook.count("Score") == 1 and hook.count("Generate") == 1
    assert ei.value.attempts == 1


def test_policy_refuses_to_retry_other_codes():
    with pytest.raises(ValueError):
        RetryPolicy(retry_codes=frozenset({grpc.StatusCode.INVALID_ARGUMENT}))


def test_backoff_is_exponential_with_full_jitter():
    p = RetryPolicy(initial_backoff=0.1, max_backoff=1.0, multiplier=2.0)
    for attempt, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        xs = [p.backoff(attempt) for _ in range(200)]
        assert 0 <= min(xs) and max(xs) <= cap and max(xs) > cap / 2


def test_server_started_after_first_attempt(artifact):
    """UNAVAILABLE (nothing listening) is retried until a server comes up on the port."""
    port = free_port()
    hook = Attempts()
    first = threading.Event()
    started: list = []

    def start_later():
        first.wait(30)
        stack = running_app(artifact, port=port)
        started.append((stack, stack.__enter__()))

    t = threading.Thread(target=start_later)
    t.start()
    try:
        def on_attempt(method, attempt):
            hook(method, attempt)
            first.set()

        with Client(f"127.0.0.1:{port}", on_attempt=on_attempt,
                    retry=RetryPolicy(max_attempts=60, **FAST)) as c:
            comp = c.generate("def add(a, b):", max_new_tokens=4, ignore_eos=True)
        assert comp.generated_tokens == 4
        assert hook.count("Generate") >= 2
    finally:
        t.join(60)
        for stack, _ in started:
            stack.__exit__(None, None, None)


def test_overloaded_server_retried_until_it_has_room(artifact, caplog):
    """max_queue=0: one Score job at a time, a second is RESOURCE_EXHAUSTED; the client retries
    with backoff and succeeds once the first is done."""
    with running_app(artifact, max_batch=1, max_queue=0, score_chunk_floats=512) as app:
        target = f"127.0.0.1:{app.port}"
        long_seqs = [[(7 * i + j) % 500 + 1 for j in range(250)] for i in range(8)]
        with Client(target, retry=RetryPolicy(max_attempts=1)) as hog_client, \
                futures.ThreadPoolExecutor(1) as pool:
            hog = pool.submit(hog_client.score, token_ids=long_seqs)
            deadline = time.monotonic() + 30
            while app.engine.load()["score_jobs"] == 0 and time.monotonic() < deadline:
                time.sleep(0.002)
            assert app.engine.load()["score_jobs"] == 1
            hook = Attempts()
            with caplog.at_level(logging.DEBUG, logger="kvserve.clients.client"), \
                    Client(target, on_attempt=hook,
                           retry=RetryPolicy(max_attempts=200, **FAST)) as c:
                res = c.score(["def add(a, b):"])
            assert hog.result(60)[0].token_count == 250
        assert res[0].token_count > 1
        assert hook.count("Score") >= 2
        assert "RESOURCE_EXHAUSTED" in caplog.text


# --- retry semantics with a scripted servicer on a real gRPC server -----------------------------
class Scripted(pb_grpc.InferenceServicer):
    """Generate: the first ``refuse`` calls are RESOURCE_EXHAUSTED; then two tokens, then either
    UNAVAILABLE (``break_stream``) or Complete."""

    def __init__(self, refuse=0, break_stream=False):
        self.refuse, self.break_stream, self.calls = refuse, break_stream, 0

    def Generate(self, request, context):  # noqa: N802
        self.calls += 1
        if self.calls <= self.refuse:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        for i in range(2):
            yield pb.GenerateResponse(chunk=pb.TokenChunk(index=i, id=i, text=f"t{i}"))
        if self.break_stream:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server went away")
        yield pb.GenerateResponse(complete=pb.Complete(
            finish_reason=pb.FINISH_REASON_LENGTH, generated_tokens=2, text="t0t1"))


def test_stream_retried_before_first_token(scripted):
    svc = Scripted(refuse=3)
    hook = Attempts()
    with Client(scripted(svc), on_attempt=hook, retry=RetryPolicy(max_attempts=5, **FAST)) as c:
        comp = c.generate("x")
    assert comp.text == "t0t1" and svc.calls == 4 and hook.count("Generate") == 4


def test_retries_are_bounded(scripted):
    svc = Scripted(refuse=100)
    with Client(scripted(svc), retry=RetryPolicy(max_attempts=3, **FAST)) as c:
        with pytest.raises(KvserveError) as e:
            c.generate("x")
    assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.attempts == 3
    assert svc.calls == 3


def test_stream_not_retried_after_tokens_were_delivered(scripted):
    svc = Scripted(break_stream=True)
    got = []
    with Client(scripted(svc), retry=RetryPolicy(max_attempts=5, **FAST), resume=False) as c:
        with pytest.raises(KvserveError) as e:
            for ev in c.generate_stream("x"):
                got.append(ev.text)
    assert got == ["t0", "t1"]
    assert e.value.code is grpc.StatusCode.UNAVAILABLE and svc.calls == 1


def test_async_stream_not_retried_after_tokens(scripted):
    svc = Scripted(break_stream=True)
    target = scripted(svc)

    async def go():
        got = []
        async with AsyncClient(target, retry=RetryPolicy(max_attempts=5, **FAST),
                               resume=False) as c:
            with pytest.raises(KvserveError):
                async for ev in c.generate_stream("x"):
                    got.append(ev.text)
        return got

    assert asyncio.run(go()) == ["t0", "t1"] and svc.calls == 1


class CancelsFirst(pb_grpc.InferenceServicer):
    """Score: the first ``cancel`` calls end CANCELLED, as gRPC ends calls that reach a server
    while it stops; then an answer."""

    def __init__(self, cancel=1):
        self.cancel, self.calls = cancel, 0

    def Score(self, request, context):  # noqa: N802
        self.calls += 1
        if self.calls <= self.cancel:
            context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        return pb.ScoreResponse(sequences=[pb.SequenceScore(token_count=1)])


def test_unary_call_cancelled_by_the_server_is_retried(scripted):
    """A unary call this client cannot have cancelled (only closing it would) and that ends
    CANCELLED was cancelled by the server (a restart): Score is idempotent, so it is retried
    as UNAVAILABLE is; without retries the CANCELLED is reported as it came."""
    svc = CancelsFirst()
    target = scripted(svc)
    with Client(target, retry=RetryPolicy(max_attempts=3, **FAST)) as c:
        assert c.score(token_ids=[[1, 2]])[0].token_count == 1
    assert svc.calls == 2
    with Client(target, retry=RetryPolicy(max_attempts=1)) as c:
        svc.calls, svc.cancel = 0, 1
        with pytest.raises(KvserveError) as e:
            c.score(token_ids=[[1, 2]])
    assert e.value.code is grpc.StatusCode.CANCELLED and svc.calls == 1

    async def go():
        svc.calls, svc.cancel = 0, 2
        async with AsyncClient(target, retry=RetryPolicy(max_attempts=3, **FAST)) as c:
            return (await c.score(token_ids=[[1, 2]]))[0].token_count

    assert asyncio.run(go()) == 1 and svc.calls == 3


def test_bearer_token_sent(artifact):
    with running_app(artifact, auth_token="s3cret") as app:
        target = f"127.0.0.1:{app.port}"
        with Client(target, retry=RetryPolicy(max_attempts=3, **FAST)) as c:
            with pytest.raises(KvserveError) as e:
                c.tokenize(["a"])
        assert e.value.code is grpc.StatusCode.UNAUTHENTICATED and e.value.attempts == 1
        with Client(target, token="s3cret") as c:
            assert c.detokenize(c.tokenize(["abc"])) == ["abc"]


def test_per_call_timeout(target):
    with Client(target, retry=RetryPolicy(max_attempts=3, **FAST)) as c:
        with pytest.raises(KvserveError) as e:
            c.score(token_ids=[list(range(1, 250))] * 30, timeout=0.001)
    assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and e.value.attempts == 1

"""Resume over gRPC on the real tiny artifact (GenerateRequest.resume, server/resume.py): the
resumed call's chunks are the uninterrupted call's tail and its Complete is the whole; a resume
on the replica it left reads its rows from the prefix cache; bad resumes are refused with
INVALID_ARGUMENT naming the field; a draining server moves the streams of clients that resume
(UNAVAILABLE at once) while the others keep their grace."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from kvserve_testing import collect, gen_request, running_app
from kvserve.server.servicer import MOVING
from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc

PROMPT = "def add(a, b):"


def _events(chunks):
    return [(c.index, c.id, c.text, c.special) for c in chunks]


def _resumed(req: pb.GenerateRequest, ids) -> pb.GenerateRequest:
    r = pb.GenerateRequest()
    r.CopyFrom(req)
    r.resume.token_ids.extend(ids)
    return r


@pytest.mark.parametrize("sampling", [
    pb.SamplingOptions(),
    pb.SamplingOptions(temperature=0.9, seed=11),
    pb.SamplingOptions(temperature=0.9, top_k=20, seed=5, frequency_penalty=1.5,
                       repetition_penalty=1.3)], ids=["greedy", "seeded", "seeded-penalties"])
def test_a_resumed_call_continues_the_uninterrupted_one(stub, sampling):
    req = gen_request(PROMPT, 24, sampling=sampling)
    chunks, done = collect(stub.Generate(req, timeout=60))
    assert len(chunks) == 24
    for k in (1, 9, 23):
        tail, rdone = collect(stub.Generate(_resumed(req, [c.id for c in chunks[:k]]),
                                            timeout=60))
        assert _events(tail) == _events(chunks[k:]), k
        assert (rdone.finish_reason, rdone.generated_tokens, rdone.prompt_tokens, rdone.text) \
            == (done.finish_reason, done.generated_tokens, done.prompt_tokens, done.text)


def test_a_stop_string_across_the_split_over_grpc(stub):
    chunks, _ = collect(stub.Generate(gen_request(PROMPT, 24), timeout=60))
    text = "".join(c.text for c in chunks)
    a, b = "".join(c.text for c in chunks[:6]), chunks[6].text
    assert b  # the stop string: the end of chunk 5's text and the start of chunk 6's
    stop = a[-3:] + b[:2]
    req = gen_request(PROMPT, 24, stop=[stop])
    full, done = collect(stub.Generate(req, timeout=60))
    assert done.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and stop in text
    for k in range(1, len(full)):
        tail, rdone = collect(stub.Generate(_resumed(req, [c.id for c in full[:k]]),
                                            timeout=60))
        assert _events(tail) == _events(full[k:]), k
        assert (rdone.stop_sequence, rdone.text) == (stop, done.text)


def test_a_resume_on_the_same_replica_reads_the_prefix_cache(stub, app):
    """The stream's rows were cached when it left: the resume's prefill of prompt + delivered
    tokens takes them from the prefix cache (whole blocks), and the output is the same."""
    from kvserve.server.prefix_cache import BLOCK_TOKENS

    req = gen_request(PROMPT, 48, sampling=pb.SamplingOptions(temperature=0.9, seed=3))
    chunks, done = collect(stub.Generate(req, timeout=60))
    before = app.metrics.prefix_hits.get()
    tail, rdone = collect(stub.Generate(_resumed(req, [c.id for c in chunks[:40]]), timeout=60))
    hit = app.metrics.prefix_hits.get() - before
    assert _events(tail) == _events(chunks[40:]) and rdone.text == done.text
    prefill = done.prompt_tokens + 40
    assert prefill - BLOCK_TOKENS <= hit <= prefill, (hit, prefill)


@pytest.mark.parametrize("resume,sampling,want", [
    ([1, 2], pb.SamplingOptions(temperature=0.8), "needs its sampling.seed"),
    ([1, 10 ** 6], pb.SamplingOptions(), "resume.token_ids contains token id 1000000"),
    ([1] * 9, pb.SamplingOptions(), "resume.token_ids has 9 tokens; the limit is 8"),
], ids=["unseeded", "out-of-vocab", "too-many"])
def test_bad_resumes_are_refused(stub, resume, sampling, want):
    req = _resumed(gen_request(PROMPT, 8, sampling=sampling), resume)
    with pytest.raises(grpc.RpcError) as e:
        collect(stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and want in e.value.details()


def test_a_drain_moves_the_streams_of_clients_that_resume(artifact, monkeypatch):
    """Two streams in flight when the server starts draining (grace 60 s): the one whose
    client resumes (``resume`` present) ends at once with UNAVAILABLE while the model is held
    mid-stream; the other keeps its grace and completes."""
    with running_app(artifact) as app:
        gate = threading.Event()
        gate.set()
        decode = app.lm.decode

        def held(*a, **kw):  # decode steps wait while the gate is closed
            gate.wait(30)
            return decode(*a, **kw)

        monkeypatch.setattr(app.lm, "decode", held)
        monkeypatch.setattr(app.engine.runner, "spec", None)  # every step a held decode
        ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
        stub = pb_grpc.InferenceStub(ch)
        movable = stub.Generate(_resumed(gen_request(PROMPT, 200), []), timeout=60)
        plain = stub.Generate(gen_request(PROMPT, 200), timeout=60)
        next(movable), next(plain)
        gate.clear()  # no token moves now: the move cannot wait for one
        drain = threading.Thread(target=app.drain, args=(60,))
        drain.start()
        with pytest.raises(grpc.RpcError) as e:
            collect(movable)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == MOVING
        assert plain.is_active()  # the plain stream goes on (the model is held still)
        gate.set()
        chunks, done = collect(plain)
        assert len(chunks) + 1 == done.generated_tokens == 200  # (its first one taken above)
        drain.join(30)
        assert not drain.is_alive()
        ch.close()


CHOICE = pb.Structured(choice=pb.ChoiceList(choices=["alpha", "beta"]))


def test_a_stream_its_constraint_ended_resumes_to_its_complete_alone(stub):
    """Every token of a stream the constraint completed: no new token (no end token after
    it), the same Complete."""
    req = gen_request(PROMPT, 16)
    req.structured.CopyFrom(CHOICE)
    chunks, done = collect(stub.Generate(req, timeout=60))
    assert done.finish_reason == pb.FINISH_REASON_CONSTRAINT
    tail, rdone = collect(stub.Generate(_resumed(req, [c.id for c in chunks]), timeout=60))
    assert tail == [] and rdone.finish_reason == done.finish_reason
    assert (rdone.generated_tokens, rdone.text) == (done.generated_tokens, done.text)


def test_a_resume_its_constraint_refuses_fails_alone(stub):
    """Tokens the constraint does not allow cannot be what this request delivered: refused
    before the engine sees them (INVALID_ARGUMENT), and a stream decoding beside it goes on."""
    bad = stub.Tokenize(pb.TokenizeRequest(texts=["zz"]), timeout=30).tokens[0].ids[:1]
    req = gen_request(PROMPT, 8)
    req.structured.CopyFrom(CHOICE)
    other = stub.Generate(gen_request(PROMPT, 200), timeout=120)
    first = next(other)
    with pytest.raises(grpc.RpcError) as e:
        collect(stub.Generate(_resumed(req, bad), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not allowed by the request's constraint" in e.value.details()
    rest, done = collect(other)
    assert first.chunk.index == 0 and done.generated_tokens == 200

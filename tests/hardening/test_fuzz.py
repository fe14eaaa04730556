"""Property-based fuzzing of the server with hypothesis.

1. Request messages with random field values (extremes, NaN, infinities, huge ints, random
   unicode, random token-id lists): the answer is OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED,
   never UNKNOWN/INTERNAL, and never a hang (every call has a deadline, and running into it
   fails the property). An OK stream has the documented shape.
2. Raw bytes on the wire to every method (a generic call with identity serializers): bytes
   that are not the request message are the server's to answer (server/wire.py parses them,
   not gRPC): INVALID_ARGUMENT "malformed <Method> request", never INTERNAL. Bytes that
   happen to parse are a request like any other. So: OK, INVALID_ARGUMENT or
   RESOURCE_EXHAUSTED; nothing else (tests/hardening/test_wire.py has the cases one by one).
After every example the server is SERVING and its engine thread alive.

CI runs a fixed set of examples (derandomized, bounded counts: a few seconds each);
KVSERVE_FUZZ_EXAMPLES=N raises the counts and KVSERVE_FUZZ_EXPLORE=1 draws new ones each run.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import grpc
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvserve.v1 import inference_pb2 as pb

SCALE = int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", "0"))
EXPLORE = os.environ.get("KVSERVE_FUZZ_EXPLORE", "") not in ("", "0")
TIMEOUT = 30.0  # per call: a hang fails the property with DEADLINE_EXCEEDED
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED}


def fuzz_settings(n: int):
    return settings(max_examples=max(n, SCALE), deadline=None, derandomize=not EXPLORE,
                    database=None, suppress_health_check=[HealthCheck.too_slow,
                                                          HealthCheck.data_too_large])


U32 = st.one_of(st.integers(0, 8), st.sampled_from([20, 21, 255, 256, 410, 411, 512, 1024, 1025,
                                                    2**31 - 1, 2**31, 2**32 - 1]),
                st.integers(0, 2**32 - 1))
U64 = st.one_of(st.integers(0, 10), st.sampled_from([2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
F32 = st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1.0, 1e-45, -1e-45, 1e-30, 0.5,
                                                      100.0, 100.00001, 3.4e38, -3.4e38]),
                st.floats(-2.0, 2.0, width=32))
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)  # valid UTF-8 only
IDS = st.lists(st.one_of(st.integers(0, 420), U32), max_size=300)
SMALL_IDS = st.lists(st.integers(0, 420), max_size=6)


def _maybe(strategy):
    return st.one_of(st.none(), strategy)


# per field: (strategy of values the server accepts, strategy of anything the type can hold)
SAMPLING_FIELDS = {
    "temperature": (st.floats(0.0, 2.0, width=32), F32),
    "top_k": (st.integers(0, 50), U32),
    "top_p": (st.floats(0.0, 1.0, width=32, exclude_min=True), F32),
    "min_p": (st.floats(0.0, 0.5, width=32), F32),
    "repetition_penalty": (st.floats(0.0, 100.0, width=32).filter(lambda v: v >= 0.01), F32),
    "presence_penalty": (st.floats(-2.0, 2.0, width=32), F32),
    "frequency_penalty": (st.floats(-2.0, 2.0, width=32), F32),
    "seed": (U64, U64),
}
OTHER_FIELDS = ["prompt", "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids",
                "top_logprobs", "attention", "request_id"]


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A third of the requests are valid, a third have one wild field, a third are wild all
    over: so that the engine runs often, and each check is reached alone and in company."""
    fields = list(SAMPLING_FIELDS) + OTHER_FIELDS
    mode = draw(st.sampled_from(["valid", "one", "wild"]))
    wild_one = draw(st.sampled_from(fields))

    def wild(name):
        return mode == "wild" or (mode == "one" and name == wild_one)

    r = pb.GenerateRequest()
    if wild("prompt"):
        which = draw(st.sampled_from(["text", "ids", "none"]))
        if which == "text":
            r.text = draw(TEXT)
        elif which == "ids":
            r.token_ids.ids.extend(draw(IDS))
    elif draw(st.booleans()):
        r.text = draw(TEXT.filter(lambda t: t.strip()).map(lambda t: t[:40]))
    else:
        r.token_ids.ids.extend(draw(st.lists(st.integers(0, 400), min_size=1, max_size=40)))
    for name, (ok, any_) in SAMPLING_FIELDS.items():
        v = draw(_maybe(any_ if wild(name) else ok))
        if v is not None:
            setattr(r.sampling, name, v)
    s = r.stopping
    s.max_new_tokens = draw(st.one_of(st.integers(0, 8), U32) if wild("max_new_tokens")
                            else st.integers(1, 8))
    s.min_new_tokens = draw(U32 if wild("min_new_tokens") else st.integers(0, 1))
    s.stop.extend(draw(st.lists(TEXT, max_size=10) if wild("stop")
                       else st.lists(TEXT.filter(bool).map(lambda t: t[:4]), max_size=3)))
    s.stop_token_ids.extend(draw(st.lists(U32, max_size=40) if wild("stop_token_ids")
                                 else st.lists(st.integers(0, 400), max_size=3)))
    s.ignore_eos = draw(st.booleans())
    o = r.response
    o.logprobs = draw(st.booleans())
    o.top_logprobs = draw(st.one_of(st.integers(0, 25), U32) if wild("top_logprobs")
                          else st.integers(0, 5))
    o.return_logits = draw(st.booleans())
    if wild("attention"):
        o.attention.layers.extend(draw(st.lists(st.one_of(st.integers(0, 3), U32), max_size=4)))
        o.attention.heads.extend(draw(st.lists(st.one_of(st.integers(0, 5), U32), max_size=6)))
    elif draw(st.booleans()):
        o.attention.layers.extend(draw(st.lists(st.integers(0, 1), min_size=1, max_size=2,
                                                unique=True)))
        o.attention.heads.extend(draw(st.lists(st.integers(0, 3), max_size=4, unique=True)))
    r.request_id = draw(TEXT if wild("request_id") else st.sampled_from(["", "req-1"]))
    return r


def _healthy(hsrv):
    assert hsrv.healthy(), "the server is no longer SERVING"


def _check_code(e: grpc.RpcError, what) -> None:
    assert e.code() in ALLOWED, (e.code(), e.details(), what)
    event(e.code().name)


@contextlib.contextmanager
def no_numeric_warnings():
    """Fail on a NumPy overflow / invalid-value warning while serving (the in-process engine
    thread reports through the same, process-wide, warnings machinery): valid parameters must
    never push the sampler into inf/NaN arithmetic."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        yield
    bad = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not bad, bad


def _tiny(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="def f(x):", sampling=pb.SamplingOptions(**sampling),
                              stopping=pb.StoppingOptions(max_new_tokens=4))


@fuzz_settings(120)
@given(req=generate_requests())
@example(req=_tiny(temperature=1e-45, seed=1))  # found by this test: inf logits, NaN draws
@example(req=_tiny(temperature=1.0, repetition_penalty=1e-45, seed=1))
def test_fuzz_generate(hsrv, req):
    with no_numeric_warnings():
        _fuzz_generate(hsrv, req)


def _fuzz_generate(hsrv, req):
    try:
        chunks, complete = [], None
        for msg in hsrv.stub.Generate(req, timeout=TIMEOUT):
            assert complete is None, "a message after Complete"
            if msg.HasField("chunk"):
                chunks.append(msg.chunk)
            else:
                complete = msg.complete
        assert complete is not None, "the stream ended without Complete"
        assert complete.generated_tokens == len(chunks)
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert complete.finish_reason not in (pb.FINISH_REASON_UNSPECIFIED,
                                              pb.FINISH_REASON_ERROR)
        event(f"OK, {pb.FinishReason.Name(complete.finish_reason)}")
    except grpc.RpcError as e:
        _check_code(e, req)
    _healthy(hsrv)


@fuzz_settings(60)
@given(which=st.sampled_from(["texts", "ids", "both"]), texts=st.lists(TEXT, max_size=40),
       ids=st.lists(st.one_of(SMALL_IDS, IDS), max_size=40),
       top=st.one_of(st.integers(0, 5), U32), rid=st.one_of(st.just(""), TEXT))
def test_fuzz_score(hsrv, which, texts, ids, top, rid):
    texts, ids = (texts if which != "ids" else []), (ids if which != "texts" else [])
    req = pb.ScoreRequest(texts=texts, token_ids=[pb.TokenIds(ids=x) for x in ids],
                          top_logprobs=top, request_id=rid)
    try:
        resp = hsrv.stub.Score(req, timeout=TIMEOUT)
        assert len(resp.sequences) == max(len(texts), len(ids))
        for s in resp.sequences:
            assert len(s.tokens) == s.token_count - 1
    except grpc.RpcError as e:
        _check_code(e, req)
    _healthy(hsrv)


@fuzz_settings(40)
@given(texts=st.lists(TEXT, max_size=20), ids=st.lists(IDS, max_size=20))
def test_fuzz_tokenize_detokenize(hsrv, texts, ids):
    try:
        toks = hsrv.stub.Tokenize(pb.TokenizeRequest(texts=texts), timeout=TIMEOUT).tokens
        back = hsrv.stub.Detokenize(pb.DetokenizeRequest(token_ids=toks), timeout=TIMEOUT).texts
        assert len(back) == len(texts)
    except grpc.RpcError as e:
        _check_code(e, texts)
    try:
        resp = hsrv.stub.Detokenize(pb.DetokenizeRequest(
            token_ids=[pb.TokenIds(ids=x) for x in ids]), timeout=TIMEOUT)
        assert len(resp.texts) == len(ids)
    except grpc.RpcError as e:
        _check_code(e, ids)
    _healthy(hsrv)


METHODS = [("/kvserve.v1.Inference/Generate", True), ("/kvserve.v1.Inference/Score", False),
           ("/kvserve.v1.Inference/Tokenize", False), ("/kvserve.v1.Inference/Detokenize", False),
           ("/kvserve.v1.Inference/ModelInfo", False), ("/grpc.health.v1.Health/Check", False)]


def _flip(data: bytes, pos: int, value: int, cut: int) -> bytes:
    """``data`` with the byte at ``pos`` set to ``value``, then cut to ``cut`` bytes (0 = not
    cut)."""
    b = bytearray(data)
    if b:
        b[pos % len(b)] = value
    return bytes(b[:cut]) if cut else bytes(b)


@fuzz_settings(60)
@given(method=st.sampled_from(METHODS),
       payload=st.one_of(
           st.binary(max_size=512),
           # valid messages with some bytes flipped / cut: closer to something that parses
           st.tuples(st.sampled_from([
               pb.GenerateRequest(text="abc", stopping=pb.StoppingOptions(
                   max_new_tokens=3, stop=["x"])).SerializeToString(),
               pb.ScoreRequest(texts=["a b"], top_logprobs=2).SerializeToString(),
               pb.DetokenizeRequest(token_ids=[pb.TokenIds(ids=[1, 2, 300])]).SerializeToString(),
           ]), st.integers(0, 40), st.integers(0, 255), st.integers(0, 60)).map(
               lambda t: _flip(*t))))
def test_fuzz_raw_bytes_on_the_wire(hsrv, method, payload):
    path, streaming = method
    call = (hsrv.channel.unary_stream if streaming else hsrv.channel.unary_unary)(
        path, request_serializer=None, response_deserializer=None)  # bytes in, bytes out
    try:
        out = call(bytes(payload), timeout=TIMEOUT)
        if streaming:
            list(out)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in e.details():
            assert e.details().startswith(f"malformed {path.rsplit('/', 1)[1]} request"), \
                e.details()
            event("INVALID_ARGUMENT (malformed)")
        elif path.startswith("/grpc.health.v1.") and e.code() == grpc.StatusCode.NOT_FOUND:
            pass  # bytes that parse as a random service name
        else:
            _check_code(e, payload)
    _healthy(hsrv)

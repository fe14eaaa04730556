"""The bad-input matrix: every field a caller sends, out of range, against a real server.

Each case expects INVALID_ARGUMENT (RESOURCE_EXHAUSTED for a message over the receive limit)
with a message that names the field and the limit, and the server still SERVING afterwards
(grpc.health.v1 and the engine thread).

Unsigned fields (max_new_tokens, top_k, token ids, ...) are uint32 in the proto: a client
library refuses to encode a negative value (``ValueError: Value out of range``), so those cases
are sent as raw bytes: a negative int32/int64 is encoded on the wire as a 10-byte varint, which
a uint32 field reads as 2^32 - 1 (protobuf truncates to 32 bits). That is what a client in
another language that puts -1 into the field sends; the server answers it like any other
out-of-range value.

The server's caps (conftest.CAPS): the tiny model's vocabulary ({V} in the expected messages),
context 256, 2 layers, 4 heads, logits and
attention 50,000 floats, 4,096 Score tokens.
"""
from __future__ import annotations

import grpc
import pytest

from hardening_helpers import collect, gen_request

from kvserve.v1 import inference_pb2 as pb

MINUS_ONE = b"\xff" * 9 + b"\x01"  # the varint of int64(-1)
U32_MAX = (1 << 32) - 1
NAN, INF = float("nan"), float("inf")


def S(**kw):
    return pb.SamplingOptions(**kw)


def G(prompt="x", n=4, **kw):
    return gen_request(prompt, n, **kw)


def raw(base: pb.GenerateRequest, field: int, inner_field: int) -> bytes:
    """``base`` with sub-message ``field``'s varint ``inner_field`` set to -1 on the wire
    (a concatenation of serialized messages is their merge)."""
    inner = bytes([inner_field << 3]) + MINUS_ONE
    return base.SerializeToString() + bytes([(field << 3) | 2, len(inner)]) + inner


def _structured(s: pb.Structured) -> pb.GenerateRequest:
    r = G()
    r.structured.CopyFrom(s)
    return r


def empty_ids_req():
    r = pb.GenerateRequest(stopping=pb.StoppingOptions(max_new_tokens=4))
    r.token_ids.SetInParent()
    return r


IA = grpc.StatusCode.INVALID_ARGUMENT
LONG_TEXT = "x " * 400  # about 400 tokens: over the context of 256

# (id, rpc, request (message or raw bytes), expected code, substrings of the message)
CASES = [
    # --- prompt ---
    ("prompt-empty-text", "Generate", G(""), IA, ["prompt is empty", "at least 1 token"]),
    ("prompt-unset", "Generate", pb.GenerateRequest(), IA,
     ["prompt is empty", "text or token_ids"]),
    ("prompt-empty-token-ids", "Generate", empty_ids_req(), IA, ["prompt is empty",
                                                                  "at least 1 token"]),
    ("prompt-text-over-context", "Generate", G(LONG_TEXT), IA,
     ["the prompt has", "the context limit is 256"]),
    ("prompt-ids-over-context", "Generate", G([5] * 300), IA,
     ["token_ids has 300 tokens", "the limit is 256"]),
    ("prompt-ids-at-context", "Generate", G([5] * 256), IA,
     ["the prompt has 256 tokens", "the context limit is 256"]),
    ("prompt-plus-new-over-context", "Generate", G([5] * 200, 100), IA,
     ["stopping.max_new_tokens (100)", "context limit 256"]),
    ("prompt-text-over-max-chars", "Generate", G("a" * 200_001), IA,
     ["text has 200001 characters", "the limit is 200000"]),
    ("prompt-token-id-vocab", "Generate", lambda v: G([1, v]), IA,
     ["token_ids", "token id {V}", "[0, {V})"]),
    ("prompt-token-id-huge", "Generate", G([1, 2, 10**6]), IA,
     ["token_ids", "token id 1000000", "[0, {V})"]),
    ("prompt-token-id-u32max", "Generate", G([U32_MAX]), IA, ["token_ids", "[0, {V})"]),
    ("prompt-token-id-negative-wire", "Generate",
     pb.GenerateRequest(stopping=pb.StoppingOptions(max_new_tokens=4)).SerializeToString()
     + bytes([(2 << 3) | 2, 1 + len(MINUS_ONE), 1 << 3]) + MINUS_ONE, IA,
     ["token_ids", f"token id {U32_MAX}", "[0, {V})"]),
    # --- stopping ---
    ("max-new-tokens-huge", "Generate", G("x", 100_000), IA,
     ["stopping.max_new_tokens", "[1, 1024]"]),
    ("max-new-tokens-u32max", "Generate", G("x", U32_MAX), IA,
     ["stopping.max_new_tokens", "[1, 1024]"]),
    ("max-new-tokens-negative-wire", "Generate", raw(G("x", 4), 4, 1), IA,
     ["stopping.max_new_tokens", "[1, 1024]"]),
    ("max-new-tokens-over-context", "Generate", G("x", 256), IA,
     ["stopping.max_new_tokens (256)", "context limit 256"]),
    ("min-new-tokens-over-max", "Generate", G("x", 4, min_new_tokens=5), IA,
     ["stopping.min_new_tokens", "[0, max_new_tokens]"]),
    ("stop-strings-too-many", "Generate", G(stop=[f"s{i}" for i in range(9)]), IA,
     ["stopping.stop has 9 strings", "the limit is 8"]),
    ("stop-string-too-long", "Generate", G(stop=["a" * 129]), IA,
     ["stopping.stop string", "1 to 128 characters"]),
    ("stop-string-empty", "Generate", G(stop=[""]), IA,
     ["stopping.stop string", "1 to 128 characters"]),
    ("stop-token-ids-too-many", "Generate", G(stop_token_ids=list(range(33))), IA,
     ["stopping.stop_token_ids has 33 ids", "the limit is 32"]),
    ("stop-token-id-unknown", "Generate", G(stop_token_ids=[10**6]), IA,
     ["stopping.stop_token_ids", "[0, {V})"]),
    # --- sampling ---
    ("temperature-negative", "Generate", G(sampling=S(temperature=-1)), IA,
     ["sampling.temperature", "[0, 100.0]"]),
    ("temperature-nan", "Generate", G(sampling=S(temperature=NAN)), IA,
     ["sampling.temperature", "finite", "[0, 100.0]"]),
    ("temperature-inf", "Generate", G(sampling=S(temperature=INF)), IA,
     ["sampling.temperature", "finite", "[0, 100.0]"]),
    ("temperature-over-max", "Generate", G(sampling=S(temperature=1e9)), IA,
     ["sampling.temperature", "[0, 100.0]"]),
    ("top-p-zero", "Generate", G(sampling=S(top_p=0)), IA, ["sampling.top_p", "(0, 1]"]),
    ("top-p-negative", "Generate", G(sampling=S(top_p=-0.5)), IA, ["sampling.top_p", "(0, 1]"]),
    ("top-p-over-one", "Generate", G(sampling=S(top_p=1.5)), IA, ["sampling.top_p", "(0, 1]"]),
    ("top-p-nan", "Generate", G(sampling=S(top_p=NAN)), IA,
     ["sampling.top_p", "finite", "(0, 1]"]),
    ("top-k-over-vocab", "Generate", lambda v: G(sampling=S(top_k=v + 1)), IA,
     ["sampling.top_k", "[0, {V}]"]),
    ("top-k-negative-wire", "Generate", raw(G(), 3, 2), IA, ["sampling.top_k", "[0, {V}]"]),
    ("min-p-negative", "Generate", G(sampling=S(min_p=-0.1)), IA, ["sampling.min_p", "[0, 1]"]),
    ("min-p-over-one", "Generate", G(sampling=S(min_p=2)), IA, ["sampling.min_p", "[0, 1]"]),
    ("min-p-nan", "Generate", G(sampling=S(min_p=NAN)), IA,
     ["sampling.min_p", "finite", "[0, 1]"]),
    ("repetition-penalty-nan", "Generate", G(sampling=S(repetition_penalty=NAN)), IA,
     ["sampling.repetition_penalty", "finite", "[0.01, 100.0]"]),
    ("repetition-penalty-inf", "Generate", G(sampling=S(repetition_penalty=INF)), IA,
     ["sampling.repetition_penalty", "finite", "[0.01, 100.0]"]),
    ("repetition-penalty-zero", "Generate", G(sampling=S(repetition_penalty=0)), IA,
     ["sampling.repetition_penalty", "[0.01, 100.0]"]),
    ("repetition-penalty-tiny", "Generate", G(sampling=S(repetition_penalty=1e-45)), IA,
     ["sampling.repetition_penalty", "[0.01, 100.0]"]),
    ("repetition-penalty-negative", "Generate", G(sampling=S(repetition_penalty=-2)), IA,
     ["sampling.repetition_penalty", "[0.01, 100.0]"]),
    ("repetition-penalty-over-max", "Generate", G(sampling=S(repetition_penalty=101)), IA,
     ["sampling.repetition_penalty", "[0.01, 100.0]"]),
    ("presence-penalty-nan", "Generate", G(sampling=S(presence_penalty=NAN)), IA,
     ["sampling.presence_penalty", "finite", "[-100.0, 100.0]"]),
    ("presence-penalty-inf", "Generate", G(sampling=S(presence_penalty=INF)), IA,
     ["sampling.presence_penalty", "finite", "[-100.0, 100.0]"]),
    ("presence-penalty-minus-inf", "Generate", G(sampling=S(presence_penalty=-INF)), IA,
     ["sampling.presence_penalty", "finite", "[-100.0, 100.0]"]),
    ("presence-penalty-over-max", "Generate", G(sampling=S(presence_penalty=101)), IA,
     ["sampling.presence_penalty", "[-100.0, 100.0]"]),
    ("frequency-penalty-nan", "Generate", G(sampling=S(frequency_penalty=NAN)), IA,
     ["sampling.frequency_penalty", "finite", "[-100.0, 100.0]"]),
    ("frequency-penalty-inf", "Generate", G(sampling=S(frequency_penalty=INF)), IA,
     ["sampling.frequency_penalty", "finite", "[-100.0, 100.0]"]),
    ("frequency-penalty-under-min", "Generate", G(sampling=S(frequency_penalty=-1e6)), IA,
     ["sampling.frequency_penalty", "[-100.0, 100.0]"]),
    # --- response ---
    ("top-logprobs-over-cap", "Generate", G(top_logprobs=21), IA,
     ["response.top_logprobs", "[0, 20]"]),
    ("logits-over-cap", "Generate", G("x", 200, return_logits=True), IA,
     ["response.return_logits", "max_new_tokens x vocab", "the limit is 50000"]),
    ("attention-over-cap", "Generate", G("x", 200, attention=pb.AttentionOptions(layers=[0, 1])),
     IA, ["response.attention", "the limit is 50000"]),
    ("attention-layer-out-of-range", "Generate", G(attention=pb.AttentionOptions(layers=[2])),
     IA, ["response.attention.layers", "[0, 2)"]),
    ("attention-layer-duplicate", "Generate", G(attention=pb.AttentionOptions(layers=[0, 0])),
     IA, ["response.attention.layers", "unique", "[0, 2)"]),
    ("attention-head-out-of-range", "Generate",
     G(attention=pb.AttentionOptions(layers=[0], heads=[4])), IA,
     ["response.attention.heads", "[0, 4)"]),
    ("attention-heads-without-layers", "Generate", G(attention=pb.AttentionOptions(heads=[0])),
     IA, ["response.attention.heads", "response.attention.layers"]),
    ("request-id-too-long", "Generate", pb.GenerateRequest(
        text="x", request_id="r" * 129, stopping=pb.StoppingOptions(max_new_tokens=2)), IA,
     ["request_id", "at most 128"]),
    # --- Score ---
    ("score-empty-batch", "Score", pb.ScoreRequest(), IA,
     ["nothing to score", "texts or token_ids", "1 to 32 sequences"]),
    ("score-oversized-batch-texts", "Score", pb.ScoreRequest(texts=["a"] * 33), IA,
     ["texts has 33 sequences", "the limit is 32"]),
    ("score-oversized-batch-ids", "Score",
     pb.ScoreRequest(token_ids=[pb.TokenIds(ids=[1, 2])] * 33), IA,
     ["token_ids has 33 sequences", "the limit is 32"]),
    ("score-texts-and-ids", "Score",
     pb.ScoreRequest(texts=["a"], token_ids=[pb.TokenIds(ids=[1])]), IA,
     ["texts or token_ids, not both"]),
    ("score-empty-sequence", "Score", pb.ScoreRequest(token_ids=[pb.TokenIds(ids=[])]), IA,
     ["sequence 0 is empty", "at least 1 token"]),
    ("score-sequence-over-context", "Score", pb.ScoreRequest(token_ids=[pb.TokenIds(
        ids=[1] * 257)]), IA, ["sequence 0 has 257 tokens", "context limit is 256"]),
    ("score-tokens-over-cap", "Score", pb.ScoreRequest(
        token_ids=[pb.TokenIds(ids=[1] * 200)] * 21), IA,
     ["4200 tokens in all", "the limit is 4096"]),
    ("score-token-id-unknown", "Score", pb.ScoreRequest(token_ids=[pb.TokenIds(
        ids=[1, 10**6])]), IA, ["sequence 0", "token id 1000000", "[0, {V})"]),
    ("score-top-logprobs-over-cap", "Score", pb.ScoreRequest(texts=["ab"], top_logprobs=21),
     IA, ["top_logprobs", "[0, 20]"]),
    ("score-text-over-max-chars", "Score", pb.ScoreRequest(texts=["a" * 200_001]), IA,
     ["text has 200001 characters", "the limit is 200000"]),
    ("structured-schema-nested-too-deeply", "Generate", _structured(pb.Structured(
        json_schema='{"items": ' * 5000 + "{}" + "}" * 5000)), IA,
     ["structured.json_schema", "nests too deeply"]),
    # --- Tokenize / Detokenize ---
    ("tokenize-too-many-texts", "Tokenize", pb.TokenizeRequest(texts=["a"] * 1025), IA,
     ["at most 1024 texts"]),
    ("tokenize-text-over-max-chars", "Tokenize", pb.TokenizeRequest(texts=["a" * 200_001]), IA,
     ["texts[0] has 200001 characters", "the limit is 200000"]),
    ("detokenize-unknown-id", "Detokenize", pb.DetokenizeRequest(
        token_ids=[pb.TokenIds(ids=[3]), pb.TokenIds(ids=[10**6])]), IA,
     ["token_ids[1]", "token id 1000000", "[0, {V})"]),
    ("detokenize-too-many-sequences", "Detokenize", pb.DetokenizeRequest(
        token_ids=[pb.TokenIds(ids=[1])] * 1025), IA, ["at most 1024 sequences"]),
    ("detokenize-sequence-too-long", "Detokenize", pb.DetokenizeRequest(
        token_ids=[pb.TokenIds(ids=[1] * 4097)]), IA,
     ["token_ids[0] has 4097 tokens", "the limit is 4096"]),
]

RESPONSES = {"Generate": pb.GenerateResponse, "Score": pb.ScoreResponse,
             "Tokenize": pb.TokenizeResponse, "Detokenize": pb.DetokenizeResponse}


def call(channel, rpc: str, request, timeout: float = 30.0):
    """Any request, message or raw bytes, through a generic call (identity serializer)."""
    data = request if isinstance(request, bytes) else request.SerializeToString()
    path = f"/kvserve.v1.Inference/{rpc}"
    de = RESPONSES[rpc].FromString
    if rpc == "Generate":
        return collect(channel.unary_stream(path, request_serializer=None,
                                            response_deserializer=de)(data, timeout=timeout))
    return channel.unary_unary(path, request_serializer=None,
                               response_deserializer=de)(data, timeout=timeout)


@pytest.mark.parametrize("rpc,request_,code,parts", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input(hsrv, rpc, request_, code, parts):
    vocab = hsrv.app.limits.vocab_size
    if callable(request_):
        request_ = request_(vocab)
    with pytest.raises(grpc.RpcError) as e:
        call(hsrv.channel, rpc, request_)
    assert e.value.code() == code, e.value.details()
    for p in parts:
        p = p.replace("{V}", str(vocab))
        assert p in e.value.details(), (p, e.value.details())
    assert hsrv.healthy()


def test_matrix_is_complete():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


def test_message_over_the_receive_limit_is_resource_exhausted(hsrv):
    """The server's grpc.max_receive_message_length is derived from its caps (a few MiB here):
    a bigger message is refused by gRPC itself, before any handler runs."""
    limit = hsrv.app.receive_limit()
    before = hsrv.app.metrics.tokens_in.get()
    with pytest.raises(grpc.RpcError) as e:
        collect(hsrv.stub.Generate(G("a" * (limit + 1024), 1), timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in e.value.details()
    assert hsrv.app.metrics.tokens_in.get() == before
    assert hsrv.healthy()
    # the next call on the same channel works
    _, done = collect(hsrv.stub.Generate(G("a", 2)))
    assert done.generated_tokens == 2


def test_max_new_tokens_zero_means_the_server_default(hsrv, artifact):
    """Not an error: the proto documents 0 as "the server default" (64), capped by the
    context left after the prompt."""
    chunks, done = collect(hsrv.stub.Generate(G("x", 0)))
    assert done.generated_tokens == len(chunks) == hsrv.app.cfg.default_max_new_tokens
    prompt = [5] * 250
    _, done = collect(hsrv.stub.Generate(G(prompt, 0)))
    assert done.generated_tokens == 256 - 250
    assert hsrv.healthy()


def test_detokenize_invalid_utf8_is_replacement_characters(hsrv, artifact):
    """Contract: Detokenize is lossy like the tokenizer's own decode and like the streamed text:
    ids whose bytes are not valid UTF-8 (a lone continuation byte, a truncated multi-byte
    character) come back as U+FFFD replacement characters, with status OK. It never fails on
    bytes and never returns invalid UTF-8 (a protobuf string could not carry it)."""
    tb = hsrv.app.token_bytes
    cont = next(i for i in range(tb.vocab_size) if tb[i] and all(0x80 <= b < 0xC0 for b in tb[i]))
    lead = next(i for i in range(tb.vocab_size) if len(tb[i]) == 1 and tb[i][0] >= 0xE0)
    ok = artifact.tokenizer.encode("ok")
    seqs = [[cont], [lead], ok + [lead] + ok, [lead, cont], ok]
    resp = hsrv.stub.Detokenize(pb.DetokenizeRequest(token_ids=[pb.TokenIds(ids=s)
                                                                for s in seqs]))
    for s, text in zip(seqs, resp.texts):
        expect = b"".join(tb[i] for i in s).decode("utf-8", errors="replace")
        assert text == expect
    assert "\ufffd" in resp.texts[0] and "\ufffd" in resp.texts[1]
    assert resp.texts[2].startswith("ok") and resp.texts[2].endswith("ok")
    assert resp.texts[4] == "ok"
    assert hsrv.healthy()


def test_tiny_temperatures_are_greedy_and_the_lowest_penalty_is_accepted(hsrv):
    """Found by the fuzz tests: temperature 1e-45 overflowed the logits to inf and drew a
    garbage token (NaN probabilities). Below 1e-5 a temperature is greedy now; the repetition
    penalty's range is [1/limit, limit], and its bounds are accepted as sent in float32."""
    def ids(**kw):
        return [c.id for c in collect(hsrv.stub.Generate(G("def add(a, b):", 12,
                                                           sampling=S(**kw))))[0]]

    greedy = ids()
    for t in (1.4e-45, 1e-38, 1e-30, 9e-6):
        assert ids(temperature=t, seed=1) == greedy, t
    assert len(ids(repetition_penalty=0.01, temperature=1.0, seed=2)) == 12
    assert len(ids(repetition_penalty=100.0)) == 12
    assert hsrv.healthy()


def test_a_handler_failure_is_internal_without_its_text(hsrv, monkeypatch):
    """An exception no handler expected (a bug) is INTERNAL with a generic message, not
    gRPC's UNKNOWN "Exception iterating responses: <its text>"; the server keeps serving."""
    from kvserve.server.servicer import InferenceServicer

    def broken(self, *a, **k):
        raise RuntimeError("/secret/internal/path")
    monkeypatch.setattr(InferenceServicer, "_generate_request", broken)
    with pytest.raises(grpc.RpcError) as e:
        call(hsrv.channel, "Generate", G())
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert e.value.details() == "Generate failed (internal error)"
    monkeypatch.undo()
    assert call(hsrv.channel, "Generate", G())[1].generated_tokens == 4 and hsrv.healthy()

"""Request bytes against a real ``kvserve serve`` (a subprocess with auth on and its default
caps), sent as raw bytes through a generic gRPC channel (no kvserve client code, no
generated stubs):

1. malformed bytes (invalid UTF-8 in every string field, lone surrogates, truncation, random
   bytes, groups nested deep) are INVALID_ARGUMENT "malformed <Method> request", one WARNING
   line each in the server's log and no traceback, counted in
   ``kvserve_malformed_requests_total``; without a token the same bytes are UNAUTHENTICATED
   and never parsed (no warning, no count);
2. requests at the message-size limit that break a cap are refused at once, each costing a
   small multiple of its size in memory: the peak RSS of the server process (VmHWM, reset
   before each request through /proc/PID/clear_refs) over its RSS before the request.
"""
from __future__ import annotations

import re
import statistics
import time

import grpc
import pytest

from hardening_helpers import scrape, served

from kvserve.bench.grpc_floor import rss_peak_during
from kvserve.v1 import inference_pb2 as pb

TOKEN = "wire-t0ken"
AUTH = [("authorization", f"Bearer {TOKEN}")]
IA = grpc.StatusCode.INVALID_ARGUMENT
STREAMING = {"Generate"}


def ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field on the wire."""
    n, out = len(payload), bytearray([(field << 3) | 2])
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out) + payload


VALID_GENERATE = pb.GenerateRequest(text="def f():", request_id="r1", stopping=pb.StoppingOptions(
    max_new_tokens=2, stop=["x"])).SerializeToString()

MALFORMED = {  # name -> (rpc, bytes)
    "generate-text-invalid-utf8": ("Generate", ld(1, b"\xc3\x28")),
    "generate-text-lone-surrogate": ("Generate", ld(1, "\ud800".encode("utf-8", "surrogatepass"))),
    "generate-text-overlong-encoding": ("Generate", ld(1, b"\xc0\xaf")),
    "generate-stop-string-invalid-utf8": ("Generate", ld(4, ld(3, b"ab\xff"))),
    "generate-request-id-invalid-utf8": ("Generate", ld(1, b"hi") + ld(6, b"\xe2\x82")),
    "generate-truncated": ("Generate", VALID_GENERATE[:len(VALID_GENERATE) - 3]),
    "generate-random-bytes": ("Generate", bytes(range(255, 0, -7)) * 3),
    "generate-deep-groups": ("Generate", b"\x0b" * 5000 + b"\x0c" * 5000),
    "generate-varint-too-long": ("Generate", b"\x28" + b"\xff" * 11),
    "generate-field-number-zero": ("Generate", b"\x00\x01"),
    "score-text-invalid-utf8": ("Score", ld(1, b"ok") + ld(1, b"\xed\xa0\x80")),
    "score-request-id-invalid-utf8": ("Score", ld(1, b"ok") + ld(4, b"\x80")),
    "score-ids-truncated": ("Score", ld(2, ld(1, b"\x01\x02\x03"))[:-2]),
    "tokenize-text-invalid-utf8": ("Tokenize", ld(1, b"abc") + ld(1, b"\xf8\x88\x80\x80\x80")),
    "tokenize-length-past-end": ("Tokenize", b"\x0a\x7fabc"),
    "detokenize-nested-truncated": ("Detokenize", b"\x0a\x05\x0a\x03\x01"),
    "detokenize-deep-groups-inside": ("Detokenize", ld(1, b"\x0b" * 300 + b"\x0c" * 300)),
    "model-info-garbage": ("ModelInfo", b"\x08"),
}


def call(channel, rpc: str, data: bytes, metadata=AUTH, timeout: float = 30.0):
    path = f"/kvserve.v1.Inference/{rpc}"
    if rpc in STREAMING:
        return list(channel.unary_stream(path, request_serializer=None,
                                         response_deserializer=None)(
            data, metadata=metadata, timeout=timeout))
    return channel.unary_unary(path, request_serializer=None, response_deserializer=None)(
        data, metadata=metadata, timeout=timeout)


def malformed_count(srv) -> float:
    return sum(v for k, v in scrape(srv.metrics_port).items()
               if k.startswith("kvserve_malformed_requests_total{"))


def warnings_in_log(srv) -> list[str]:
    return [ln for ln in srv.log().splitlines() if " WARNING " in ln and "malformed" in ln]


@pytest.fixture(scope="module")
def srv(artifact, tmp_path_factory):
    with served(artifact.dir, tmp_path_factory.mktemp("wire"), "--metrics-port", "0",
                env={"KVSERVE_AUTH_TOKEN": TOKEN}) as s:
        yield s


def _refused(srv, rpc, data, metadata=AUTH) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call(srv.channel, rpc, data, metadata)
    return e.value


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_bytes_are_invalid_argument_without_a_traceback(srv, name):
    rpc, data = MALFORMED[name]
    count, lines = malformed_count(srv), len(warnings_in_log(srv))
    e = _refused(srv, rpc, data)
    assert e.code() == IA, (e.code(), e.details())
    assert e.details().startswith(f"malformed {rpc} request: "), e.details()
    assert malformed_count(srv) == count + 1
    log = srv.log()
    new = warnings_in_log(srv)[lines:]
    assert len(new) == 1 and f"malformed {rpc} request ({len(data)} bytes)" in new[0], new
    assert "Traceback" not in log and "Exception deserializing" not in log
    assert call(srv.channel, "Tokenize", pb.TokenizeRequest(texts=["ok"]).SerializeToString())


def test_health_check_with_malformed_bytes(srv):
    """Health is exempt from auth, and parsed by the same code."""
    path = "/grpc.health.v1.Health/Check"
    with pytest.raises(grpc.RpcError) as e:
        srv.channel.unary_unary(path, request_serializer=None, response_deserializer=None)(
            ld(1, b"\xff\xfe"), timeout=10)
    assert e.value.code() == IA and e.value.details().startswith("malformed Check request")
    assert "Traceback" not in srv.log()


@pytest.mark.parametrize("name", ["generate-text-invalid-utf8", "score-ids-truncated",
                                  "generate-deep-groups", "model-info-garbage",
                                  "tokenize-text-invalid-utf8"])
@pytest.mark.parametrize("creds", ["missing", "wrong"])
def test_credentials_are_checked_before_the_body_is_parsed(srv, name, creds):
    rpc, data = MALFORMED[name]
    md = None if creds == "missing" else [("authorization", "Bearer nope")]
    count, lines = malformed_count(srv), len(warnings_in_log(srv))
    e = _refused(srv, rpc, data, md)
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (e.code(), e.details())
    assert malformed_count(srv) == count and len(warnings_in_log(srv)) == lines


# --- memory and time per request ----------------------------------------------------------------
def _receive_limit(srv) -> int:
    m = re.search(r"max request (\d+) bytes", srv.log())
    assert m, srv.log()
    return int(m.group(1))


def _ids(n: int, value: int = 1) -> pb.TokenIds:
    return pb.TokenIds(ids=[value] * n)


def big_requests(limit: int) -> dict[str, tuple[str, bytes, grpc.StatusCode, str]]:
    """Requests just under the receive limit (and one far over it), each breaking a cap:
    name -> (rpc, bytes, code, part of the message)."""
    n = limit - 16_384  # one-byte ids: n ids in about n bytes (under every method's limit)
    texts = [("x " * 50_000)] * (limit // 100_016)
    return {
        "generate-token-ids": ("Generate", pb.GenerateRequest(token_ids=_ids(n)).SerializeToString(),
                               IA, "Generate request of"),
        "score-token-ids": ("Score", pb.ScoreRequest(token_ids=[_ids(n)]).SerializeToString(),
                            IA, "tokens in all (token_ids.ids); the limit is 65536"),
        "score-many-empty-sequences": ("Score", b"\x12\x00" * (n // 2), IA,
                                       "sequences (token_ids); the limit is 32"),
        "score-long-texts": ("Score", pb.ScoreRequest(texts=texts).SerializeToString(), IA,
                             "characters in all (texts.chars); the limit is 800000"),
        "tokenize-long-texts": ("Tokenize", pb.TokenizeRequest(texts=texts).SerializeToString(),
                                IA, "characters in all (texts.chars); the limit is 800000"),
        "tokenize-many-empty-texts": ("Tokenize", b"\x0a\x00" * (n // 2), IA,
                                      "texts (texts); the limit is 1024"),
        "detokenize-token-ids": ("Detokenize", pb.DetokenizeRequest(
            token_ids=[_ids(n)]).SerializeToString(), IA, "Detokenize request of"),
        # 20M ids (40 MB) of id 300, packed: far over the receive limit
        "generate-20m-ids": ("Generate", ld(2, ld(1, b"\xac\x02" * 20_000_000)),
                             grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    }


def test_requests_at_the_size_limit_cost_about_their_size(srv):
    limit = _receive_limit(srv)
    assert 3_000_000 < limit < 4_000_000  # 4 x max_prompt_chars characters of UTF-8, and some
    pid = srv.proc.pid
    report = []
    requests = big_requests(limit)
    _refused(srv, *requests["generate-token-ids"][:2])  # gRPC's own first-call buffers
    for name, (rpc, data, code, part) in requests.items():
        assert len(data) <= limit or code == grpc.StatusCode.RESOURCE_EXHAUSTED, name
        size = min(len(data), limit)  # gRPC holds no more than the limit of a bigger one
        peaks, times = [], []
        for _ in range(3):
            t0 = time.monotonic()
            peak, e = rss_peak_during(pid, lambda: _refused(srv, rpc, data))
            times.append(time.monotonic() - t0)
            peaks.append(peak)
            assert e.code() == code and part in e.details(), (name, e.code(), e.details())
        seconds = statistics.median(times)
        report.append(f"{name}: {len(data) / 1e6:.1f} MB, peak RSS +"
                      f"{'/'.join(f'{p / 1e6:.1f}' for p in peaks)} MB, "
                      f"{'/'.join(f'{t * 1000:.0f}' for t in times)} ms")
        # what reaches kvserve's code is gRPC's receive buffer and the bytes handed to Python
        # (~2x), and kvserve's own check allocates 64 KiB chunks (the next test). One call can
        # show up to ~3x before any kvserve code runs (generate-token-ids is refused on its
        # length alone): grpcio assembles the message in a bytearray before it hands over the
        # bytes, and calls land on different threads and malloc arenas (bench/grpc_floor.py:
        # a bare grpcio server, 1.8-2.7x per call). The process-wide peak also catches whatever
        # else the server allocates meanwhile: one call in CI once read 5.1x (16.4 MB for 3.2)
        # while the other two read 1.4x and 2.7x. So the typical call (the median of three)
        # is held to 3x, and every call to 6x. Before the fix: ~1 GB for 40 MB (25x).
        # A message far over the limit never reaches kvserve: what the server holds of it is
        # the HTTP/2 frames grpc-core took in before refusing it, which follows the flow-control
        # window rather than the limit (measured 0-15 MB a call, CI once 9.7/13.4/14.9 MB). For
        # that one every call is held to 6x the limit, about half the message itself.
        where = [report[-1]] + report[:-1]  # the failing request first in the message
        assert max(peaks) <= 6 * size + (2 << 20), where
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert 6 * size + (2 << 20) < 0.6 * len(data)  # that bound: about half the message
            continue  # its time is the time to send 40 MB
        assert statistics.median(peaks) <= 3 * size + (2 << 20), where
        # a guard, not the benchmark (measured here: 3-15 ms; the target is 0.5 s; before the
        # fix: 2-6 s)
        assert seconds < 1.5, where
    print("\n".join(report))
    assert call(srv.channel, "Tokenize", pb.TokenizeRequest(texts=["ok"]).SerializeToString())


@pytest.mark.parametrize("n", [9, 100])
def test_a_cap_is_named_once_whoever_refuses(srv, n):
    """Just over the cap the servicer refuses; far over it the wire check does, while reading:
    both name the same one limit (the wire check used to say "more than 32 ...; the limit is
    8")."""
    data = pb.GenerateRequest(text="hi", stopping=pb.StoppingOptions(
        max_new_tokens=2, stop=[f"s{i}" for i in range(n)])).SerializeToString()
    e = _refused(srv, "Generate", data)
    assert e.code() == IA and "the limit is 8" in e.details(), e.details()
    assert "32" not in e.details() and "more than" not in e.details(), e.details()


def test_score_texts_stop_tokenizing_at_the_token_budget(srv):
    """Within the character budget (4 x 200,000) but far over the token budget (65,536): the
    texts are tokenized one at a time and the call is refused after the first, not after all
    (before the fix: every text tokenized, 4-6 s for 32 texts of 200k characters)."""
    text = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(200_000))  # ~1 token/char
    data = pb.ScoreRequest(texts=[text] * 4).SerializeToString()
    e = _refused(srv, "Score", data)
    assert e.code() == IA and "tokens in all after 1 of 4; the limit is 65536" in e.details(), \
        e.details()


def test_the_wire_check_allocates_a_chunk_not_the_request():
    """In process, under tracemalloc: what kvserve's own check (step 2 of server/wire.py)
    allocates for each request at the size limit is a bounded chunk (it slices 64 KiB at a
    time), not a multiple of the request. The rest of the process-level peak above is
    grpcio's receive path, which holds a message about three times over at its peak (the
    core's slices, the bytearray it assembles, the bytes it hands over: ``bench/grpc_floor.py``
    measures a bare grpcio server with the same bytes)."""
    import tracemalloc

    from kvserve.server.config import ServerConfig
    from kvserve.server.validation import Limits
    from kvserve.server.wire import OverLimit, count_repeated, receive_limit, request_limits

    cfg = ServerConfig()
    limits = request_limits(cfg, Limits.make(cfg, vocab_size=512, n_layers=2, n_heads=4,
                                             max_seq_len=256))
    limit = receive_limit(limits)
    descs = {m.name: m.input_type for m in pb.DESCRIPTOR.services_by_name["Inference"].methods}
    checked = []
    for name, (rpc, data, code, _) in big_requests(limit).items():
        method = limits[f"/kvserve.v1.Inference/{rpc}"]
        if len(data) > method.max_bytes:
            continue  # refused on its length alone (step 1), before anything is read
        tracemalloc.start()
        try:
            with pytest.raises(OverLimit):
                count_repeated(data, descs[rpc], method.caps)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak <= 3 * (64 << 10), (name, len(data), peak)
        checked.append(name)
    assert len(checked) >= 5, checked

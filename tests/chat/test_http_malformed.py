"""Malformed HTTP and text the tokenizer cannot take, sent over raw sockets to the real server:
never a 500, never a traceback in the log. aiohttp's parser refuses the malformed requests
itself (400) and the server logs each in one line; a JSON string with a lone surrogate is
refused with a 400 naming the field (before it reaches the tokenizer)."""
from __future__ import annotations

import json
import logging
import socket

import pytest

from chat_helpers import TOKEN

AUTH = f"Authorization: Bearer {TOKEN}\r\n"


def raw(port: int, data: bytes) -> tuple[int, bytes]:
    """Send ``data``, read until the server closes; (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(data)
        got = b""
        while True:
            part = s.recv(65536)
            if not part:
                break
            got += part
            head, sep, body = got.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    break
    status_line = got.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1."), got[:200]
    return int(status_line.split()[1]), got.partition(b"\r\n\r\n")[2]


def post_bytes(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{AUTH}"
            f"{extra}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


MALFORMED = {
    "request line over 8 KB": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "header over 8 KB": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000
                         + b"\r\n\r\n"),
    "Content-Length with Transfer-Encoding": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    "bad method": b"G\x00T / HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad version": b"GET / HTTP/9.9x\r\nHost: x\r\n\r\n",
    "bad chunk size": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_requests_get_400_and_one_log_line(chat_app, caplog, name):
    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        status, _ = raw(chat_app.http_port, MALFORMED[name])
    assert 400 <= status < 500, (name, status)
    assert "Traceback" not in caplog.text, caplog.text
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]
    if name != "bad method":  # (aiohttp logs a first bad method at DEBUG: internet noise)
        lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.server"]
        assert len(lines) == 1 and "refused a malformed HTTP request" in lines[0], lines
        assert "\n" not in lines[0]


LONE = [
    ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "a\udfffb"], "max_tokens": 2}, "prompt[1]"),
    ("/v1/completions", {"prompt": "ok", "max_tokens": 2, "stop": ["\ud83d"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \udc00"}],
                              "max_tokens": 2}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "us\ud800er", "content": "hi"}],
                              "max_tokens": 2}, "messages[0].role"),
]


@pytest.mark.parametrize("path,body,field", LONE)
def test_lone_surrogates_are_refused_naming_the_field(chat_app, caplog, path, body, field):
    data = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as "\ud800"
    assert b"\\ud" in data
    with caplog.at_level(logging.INFO):
        status, out = raw(chat_app.http_port, post_bytes(path, data))
    assert status == 400, (status, out[:300])
    msg = json.loads(out)["error"]["message"]
    assert field in msg, msg
    assert "Unicode" in msg or "printable" in msg, msg  # (a role is refused as unprintable)
    assert "Traceback" not in caplog.text
    # the server goes on
    ok = json.dumps({"prompt": "ok", "max_tokens": 2}).encode()
    status, out = raw(chat_app.http_port, post_bytes("/v1/completions", ok))
    assert status == 200, out[:300]


def test_grpc_text_prompts_are_utf8_by_protobuf():
    """The gRPC side cannot carry a lone surrogate at all: protobuf refuses to serialize it, so
    the client fails before sending (the server's check is for the HTTP API's JSON)."""
    from kvserve.v1 import inference_pb2 as pb

    with pytest.raises((ValueError, UnicodeEncodeError)):
        pb.GenerateRequest(text="\ud800").SerializeToString()


def test_the_check_names_the_field_on_every_path():
    """One place (validation.check_text / check_unicode) covers prompts, Score and Tokenize
    texts, chat messages and stop strings."""
    from kvserve.server import validation as V
    from kvserve.server.domain import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"texts\[3\] is not valid Unicode"):
        V.check_unicode("texts[3]", "ab\ud800")
    assert V.check_unicode("x", "naïve 😀") == "naïve 😀"


ECHOED = [
    ("/v1/completions", {"model": "m\ud800", "prompt": "ok", "max_tokens": 2}),
    ("/v1/completions", {"prompt": "ok", "max_tokens": 2, "\ud800": 1}),
    ("/v1/completions", {"prompt": "ok", "max_tokens": 2, "user": "\ud800"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "\udfff": "x"}],
                              "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "response_format": {"type": "\ud800"}}),
]


@pytest.mark.parametrize("path,body", ECHOED)
def test_a_lone_surrogate_anywhere_is_never_a_500(chat_app, caplog, path, body):
    """Any string field, even one the server only echoes in its error message."""
    with caplog.at_level(logging.INFO):
        status, out = raw(chat_app.http_port, post_bytes(path, json.dumps(body).encode()))
    assert status < 500, (status, out[:300])
    json.loads(out)  # a JSON body (the surrogate, when echoed, as a \\u escape)
    assert "Traceback" not in caplog.text

"""Bad input over HTTP gets a 4xx with OpenAI's error object and a clear message, and the server
keeps serving; a client that disconnects mid-stream frees its slot; capacity is 429, draining
503, a model without a chat template 400 (gRPC: FAILED_PRECONDITION)."""
from __future__ import annotations

import http.client
import json
import socket
import time

import grpc
import pytest

from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc

from chat_helpers import TOKEN
from kvserve_testing import collect, gen_request, running_app

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def post(port, path, body, token=TOKEN, raw=None, ctype="application/json"):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": ctype}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    c.request("POST", path, body=data, headers=headers)
    r = c.getresponse()
    out = r.status, r.read()
    c.close()
    return out


def err(status_body):
    status, body = status_body
    e = json.loads(body)["error"]
    assert set(e) == {"message", "type", "param", "code"}
    return status, e["message"]


BAD = [
    (CHAT, None, b"{not json", 400, "not valid JSON"),
    (CHAT, None, b"[1, 2]", 400, "JSON object"),
    (CHAT, None, b'{"messages": NaN}', 400, "not valid JSON"),
    (CHAT, None, b"[" * 100_000 + b"]" * 100_000, 400, "nests too deeply"),
    (CHAT, None, b"\xff\xfe", 400, "UTF-8"),
    (CHAT, {"messages": "hi"}, None, 400, "'messages' must be"),
    (CHAT, {"messages": []}, None, 400, "'messages' must be"),
    (CHAT, {"messages": [{"role": 1, "content": "x"}]}, None, 400, "string 'role'"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, None, 400, "content must be"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400,
     "only text"),
    (CHAT, {"messages": MSG * 9}, None, 400, "the limit is 8"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 3000}]}, None, 400, "the limit is 2000"),
    (CHAT, {"messages": MSG, "max_tokens": "5"}, None, 400, "'max_tokens' must be an integer"),
    (CHAT, {"messages": MSG, "max_tokens": 10 ** 30}, None, 400, "'max_tokens' is"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, None, 400, "'max_tokens' is 0"),
    (CHAT, {"messages": MSG, "n": 10 ** 9}, None, 400, "'n' is"),
    (CHAT, {"messages": MSG, "n": True}, None, 400, "'n' must be an integer"),
    (CHAT, {"messages": MSG, "temperature": 1e308}, None, 400, "'temperature' is"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, None, 400, "'temperature' must be a number"),
    (CHAT, {"messages": MSG, "top_p": 0}, None, 400, "'top_p' is 0"),
    (CHAT, {"messages": MSG, "seed": 2 ** 80}, None, 400, "'seed' is"),
    (CHAT, {"messages": MSG, "stop": ["x"] * 50}, None, 400, "'stop' has 50"),
    (CHAT, {"messages": MSG, "stop": 3}, None, 400, "'stop' must be"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, None, 400, "needs 'logprobs'"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 999}, None, 400, "'top_logprobs'"),
    (CHAT, {"messages": MSG, "stream": "yes"}, None, 400, "'stream' must be true or false"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, None, 400, "tools[0].function"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, None,
     400, "no tool-call format"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, None, 400, "needs 'tools'"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, None, 400,
     "response_format.type"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"tools": 1}}, None, 400,
     "set by the server"),
    (CHAT, {"messages": MSG, "continue_final_message": True, "add_generation_prompt": True},
     None, 400, "cannot both be true"),
    (CHAT, {"messages": MSG, "frobnicate": 1}, None, 400, "unrecognized request argument"),
    (CHAT, {"messages": MSG, "model": "nope"}, None, 404, "does not exist"),
    (CHAT, {"messages": MSG, "model": ["x"]}, None, 400, "'model' must be a string"),
    (CHAT, {"messages": [{"role": "user", "content": "x y" * 600}], "max_tokens": 1000}, None,
     400, "context"),
    ("/v1/completions", {"prompt": 5}, None, 400, "'prompt' must be"),
    ("/v1/completions", {"prompt": [10 ** 12]}, None, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": ["a"] * 50}, None, 400, "the limit is 4"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 3}, None, 400, "choices"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, None, 400, "'max_tokens' is 0"),
    ("/v1/completions", {"prompt": "x", "echo": True, "prompt_logprobs": 10 ** 6}, None, 400,
     "'prompt_logprobs' is"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, None, 400, "'suffix' is not supported"),
    ("/v1/completions", {}, None, 400, "'prompt' is required"),
    ("/v1/completions", None, b"x" * (2 << 20), 413, "over the limit"),
    # max_tokens 0 with echo generates nothing, and its prompt is held to the same bounds
    ("/v1/completions", {"prompt": "", "echo": True, "max_tokens": 0, "logprobs": 1}, None, 400,
     "the prompt is empty"),
    ("/v1/completions", {"prompt": [[]], "echo": True, "max_tokens": 0}, None, 400,
     "the prompt is empty"),
    ("/v1/completions", {"prompt": ["a", "x y" * 700], "echo": True, "max_tokens": 0,
                         "logprobs": 1, "stream": True}, None, 400, "prompt 1 has"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, None, 400,
     "only allowed with 'stream': true"),
    # JSON strings may carry lone surrogates; constraints refuse them like prompts do
    ("/v1/completions", None, b'{"prompt": "a", "guided_regex": "\\ud800"}', 400,
     "guided_regex is not valid Unicode"),
    ("/v1/completions", None, b'{"prompt": "a", "guided_choice": ["\\udc00"]}', 400,
     "guided_choice[0] is not valid Unicode"),
    ("/v1/completions", {"prompt": "a", "guided_json": False}, None, 400, "no output matches"),
]


@pytest.mark.parametrize("path,body,raw,status,fragment", BAD,
                         ids=[f"{i}-{b[4]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_clear_4xx(chat_app, path, body, raw, status, fragment):
    got, msg = err(post(chat_app.http_port, path, body, raw=raw))
    assert (got, fragment in msg) == (status, True), msg
    assert "Traceback" not in msg


def test_no_content_type_is_json_and_other_types_are_415(chat_app):
    c = http.client.HTTPConnection("127.0.0.1", chat_app.http_port, timeout=60)
    # (greedy, past the end-of-text token: a sampled draw of it ended the completion early now
    # and then, ~1% of runs on the test models)
    body = json.dumps({"prompt": "a", "max_tokens": 2, "temperature": 0,
                       "ignore_eos": True}).encode()
    c.request("POST", "/v1/completions", body=body, headers={
        "Authorization": f"Bearer {TOKEN}"})  # (http.client adds no Content-Type)
    r = c.getresponse()
    assert r.status == 200, r.read()
    assert json.loads(r.read())["usage"]["completion_tokens"] == 2
    c.close()
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        status, msg = err(post(chat_app.http_port, "/v1/completions", {"prompt": "a"},
                               ctype=ctype))
        assert status == 415 and "application/json" in msg


@pytest.mark.parametrize("scheme", ["bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(chat_app, scheme):
    c = http.client.HTTPConnection("127.0.0.1", chat_app.http_port, timeout=60)
    c.request("GET", "/v1/models", headers={"Authorization": f"{scheme} {TOKEN}"})
    assert c.getresponse().status == 200
    c.close()


def test_an_unexpected_failure_is_a_json_500_without_internals(chat_app, monkeypatch):
    import kvserve.server.http_api as H

    def broken(*a, **k):
        raise RuntimeError("/secret/internal/path")
    monkeypatch.setattr(H, "parse_completion", broken)
    status, body = post(chat_app.http_port, "/v1/completions", {"prompt": "a"})
    e = json.loads(body)["error"]
    assert status == 500 and e["code"] == "internal_error" and e["type"] == "server_error"
    assert "secret" not in body.decode() and "Traceback" not in body.decode()
    monkeypatch.undo()
    status, body = post(chat_app.http_port, "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert status == 200


def test_server_keeps_serving_after_bad_input(chat_app):
    for path, body, raw, _, _ in BAD[:6]:
        post(chat_app.http_port, path, body, raw=raw)
    status, body = post(chat_app.http_port, CHAT, {"messages": MSG, "max_tokens": 3})
    assert status == 200 and json.loads(body)["choices"][0]["message"]["role"] == "assistant"
    status, body = post(chat_app.http_port, "/v1/nothing", {})
    assert status == 404 and "error" in json.loads(body)


def test_disconnect_cancels_the_request(chat_app):
    before = chat_app.metrics.requests.get(rpc="Generate", outcome="cancelled")
    s = socket.create_connection(("127.0.0.1", chat_app.http_port))
    body = json.dumps({"prompt": "for", "max_tokens": 900, "stream": True,
                       "ignore_eos": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
              + body)
    got = b""
    while b"data: " not in got:  # streaming has begun
        part = s.recv(4096)
        assert part, got
        got += part
    s.close()
    end = time.monotonic() + 20
    while chat_app.metrics.requests.get(rpc="Generate", outcome="cancelled") == before:
        assert time.monotonic() < end, "the disconnected stream kept decoding"
        time.sleep(0.02)


def test_capacity_draining_and_no_template(artifact):
    """The session's plain artifact has no chat template; one slot, no queue."""
    with running_app(artifact, http_port=0, max_batch=1, max_queue=0) as app:
        port = app.http_port
        status, body = post(port, CHAT, {"messages": MSG}, token=None)
        assert status == 400 and "no chat template" in json.loads(body)["error"]["message"]
        with grpc.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = pb_grpc.InferenceStub(ch)
            req = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(
                role="user", content="hi")]))
            with pytest.raises(grpc.RpcError) as e:
                collect(stub.Generate(req))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "no chat template" in e.value.details()
            # the one slot busy with a gRPC stream (250 tokens): HTTP gets 429 (a stream that
            # ends before the POST lands is retried, a few times at most)
            for _ in range(5):
                call = stub.Generate(gen_request("for", 250))
                next(call)
                status, body = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 2},
                                    token=None)
                call.cancel()
                if status != 200:
                    break
            assert status == 429 and "capacity" in json.loads(body)["error"]["message"]
        app.state.draining = True
        try:
            status, body = post(port, "/v1/completions", {"prompt": "x"}, token=None)
            assert status == 503 and "shutting down" in json.loads(body)["error"]["message"]
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("GET", "/health")
            assert c.getresponse().status == 503
        finally:
            app.state.draining = False


def test_health_is_503_until_warmed_up():
    """The HTTP server starts before the warm-up (App.start); until the state says ready,
    /health and the API answer 503."""
    from kvserve.server.http_api import HttpServer, OpenAIApi
    from kvserve.server.state import ServingState

    state = ServingState()
    srv = HttpServer(OpenAIApi(None, None, None, state, None, "m", 0), "127.0.0.1", 0, 1 << 20)
    port = srv.start()

    def get(path):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", path)
        r = c.getresponse()
        out = r.status, json.loads(r.read())
        c.close()
        return out

    try:
        assert get("/health") == (503, {"status": "loading"})
        status, body = get("/v1/models")
        assert status == 503 and "still loading" in body["error"]["message"]
        state.ready = True
        assert get("/health") == (200, {"status": "ok", "model": "m"})
        assert get("/v1/models")[1]["data"][0]["id"] == "m"
    finally:
        srv.stop()

"""A model saved as ``kvserve train`` saves it can chat with no manual step: its tokenizer
reserves ChatML's tokens and its checkpoint carries ChatML's template, which export copies into
the artifact; ``<|im_end|>`` ends an answer. ``kvserve chat`` checks the model at start-up and
says at once, in one line, when it cannot chat (or the server is not there)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from kvserve_testing import build_artifact, free_port, running_app

from kvserve.model.tokenizer import IM_END
from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def trained_app(tmp_path_factory):
    art = build_artifact(tmp_path_factory.mktemp("trained_chat"), attention=False, chat=True)
    with running_app(art, http_port=0) as app:
        yield art, app


def chat_cli(port: int, stdin: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVSERVE_LOG_LEVEL": "WARNING"}
    env.pop("KVSERVE_AUTH_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "chat", "--server",
                           f"127.0.0.1:{port}", "--retries", "0", *extra],
                          input=stdin, capture_output=True, text=True, env=env, timeout=120)


def test_the_artifact_carries_chatml_and_im_end_ends_answers(trained_app):
    art, app = trained_app
    cfg = json.loads((art.dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in cfg["chat_template"] and cfg["eos_token"] == IM_END
    manifest = json.loads((art.dir / "manifest.json").read_text())
    assert "tokenizer_config.json" in json.dumps(manifest)  # hashed like every file
    with grpc.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        info = pb_grpc.InferenceStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=30)
    assert info.chat_template_available
    assert set(info.eos_token_ids) == {art.tokenizer.eos_id, art.tokenizer.token_to_id(IM_END)}


def test_openai_chat_completions_answer(trained_app):
    openai = pytest.importorskip("openai")
    _, app = trained_app
    with openai.OpenAI(base_url=f"http://127.0.0.1:{app.http_port}/v1", api_key="unused",
                       max_retries=0, timeout=60) as c:
        r = c.chat.completions.create(model="artifact", max_tokens=5,
                                      messages=[{"role": "user", "content": "hello"}])
    assert r.choices[0].finish_reason in ("length", "stop")
    # the prompt is the ChatML rendering: 3 ChatML tokens + role/content tokens
    assert r.usage.prompt_tokens >= 5 and 1 <= r.usage.completion_tokens <= 5


def test_kvserve_chat_answers_on_a_trained_model(trained_app):
    _, app = trained_app
    p = chat_cli(app.port, "hello\n", "--max-new-tokens", "4", "--stats")
    assert p.returncode == 0, p.stderr
    assert "kvserve chat with" in p.stderr
    assert "[length;" in p.stderr or "[eos_token;" in p.stderr, p.stderr


def test_kvserve_chat_says_at_once_when_the_model_cannot_chat(artifact):
    """The session's plain artifact has no template: one line before any prompt, exit 1."""
    with running_app(artifact) as app:
        p = chat_cli(app.port, "hello\n")
    assert p.returncode == 1
    assert p.stdout == ""  # no "you> " prompt was shown
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "cannot chat" in lines[0] and "no usable chat template" in lines[0], p.stderr


def test_kvserve_chat_without_a_server_names_the_address_given():
    port = free_port()
    env = {**os.environ, "KVSERVE_LOG_LEVEL": "WARNING"}
    p = subprocess.run([sys.executable, "-m", "kvserve.cli", "chat", "--server",
                        f"localhost:{port}", "--retries", "0"], input="hello\n",
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip() == (f"kvserve chat: UNAVAILABLE: cannot connect to localhost:{port} "
                                "(Connection refused); is the server running there?"), p.stderr

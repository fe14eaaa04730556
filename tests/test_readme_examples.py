"""The README's examples of a running server, run as written against a real one (the tiny test
model, which has no chat template, like the model `kvserve train` makes): the gRPC stubs and
Python client snippets, the curl lines and the official `openai` client snippet. Only the
addresses change: `localhost:50051` and `localhost:8000` become the test server's ports.
grpcurl's line runs where grpcurl is installed."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve_testing import running_app

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(lang: str, text: str | None = None) -> list[str]:
    """The fenced code blocks of one language, in order."""
    return re.findall(rf"```{lang}\n(.*?)```", text if text is not None else README.read_text(),
                      re.S)


def http_section() -> str:
    text = README.read_text()
    return text.split("<!-- readme-http:start -->", 1)[1].split("<!-- readme-http:end -->")[0]


def one(snippets: list[str], needle: str) -> str:
    found = [s for s in snippets if needle in s]
    assert len(found) == 1, (needle, len(found))
    return found[0]


@pytest.fixture(scope="module")
def app(artifact):
    with running_app(artifact, http_port=0, served_model_name="default") as a:
        yield a


def at(app, code: str) -> str:
    return code.replace("localhost:50051", f"127.0.0.1:{app.port}").replace(
        "localhost:8000", f"127.0.0.1:{app.http_port}")


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    return out.stdout


def test_grpc_stubs_example(app):
    out = run_python(at(app, one(blocks("python"), "inference_pb2_grpc")))
    assert out.rstrip().splitlines()[-1].strip() in ("FINISH_REASON_LENGTH",
                                                      "FINISH_REASON_EOS_TOKEN")


def test_python_client_example(app):
    out = run_python(at(app, one(blocks("python"), "from kvserve.clients import Client")))
    lines = out.rstrip().splitlines()
    reason, count = lines[-2].split()
    assert reason in ("length", "eos_token") and 0 < int(count) <= 16
    label, value = lines[-1].split()
    assert label == "perplexity" and float(value) > 1.0


def test_curl_and_openai_examples(app):
    section = http_section()
    curls = at(app, one(blocks("bash", section), "curl "))
    assert curls.count("curl ") == 2
    out = subprocess.run(["bash", "-euo", "pipefail", "-c",
                          curls.replace("curl -s", "curl --fail-with-body -s")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    dec = json.JSONDecoder()
    completion, end = dec.raw_decode(out.stdout)
    assert completion["object"] == "text_completion" and completion["model"] == "default"
    assert 0 < completion["usage"]["completion_tokens"] <= 32
    assert json.loads(out.stdout[end:]) == {"status": "ok", "model": "default"}
    pytest.importorskip("openai")
    text = run_python(at(app, one(blocks("python", section), "from openai import OpenAI")))
    assert text.strip()


def test_the_serve_line_and_grpcurl(app):
    serve = one(blocks("bash"), "--http-port 8000").strip()
    assert serve.startswith("kvserve serve artifacts/default --port 50051 --http-port 8000  ")
    assert serve.endswith("# or KVSERVE_HTTP_PORT=8000 bash scripts/main.sh")
    grpcurl = one(blocks("bash"), "grpcurl ")
    if shutil.which("grpcurl") is None:
        pytest.skip("grpcurl is not installed (its line is checked for its shape only)")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", at(app, grpcurl)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"complete"' in out.stdout

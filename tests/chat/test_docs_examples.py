"""docs/http-api.md's curl examples, run as written (only `localhost:8000` becomes the test server's
address, and curl gets --fail-with-body so that an HTTP error fails the run) against a real
server whose model has a chat template and is served as `default`."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve_testing import running_app

DOC = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"


def examples() -> str:
    text = DOC.read_text()
    block = text.split("<!-- http-examples:start -->", 1)[1].split("<!-- http-examples:end -->")[0]
    return block.split("```bash\n", 1)[1].split("```", 1)[0]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_http_doc_curl_examples_work_as_written(chat_artifact):
    script = examples()
    lines = script.splitlines()
    assert lines[0].startswith("kvserve serve ") and "--http-port 8000" in lines[0]
    curls = "\n".join(lines[1:])
    assert curls.count("curl ") == 5
    with running_app(chat_artifact, http_port=0, served_model_name="default") as app:
        run = curls.replace("localhost:8000", f"127.0.0.1:{app.http_port}")
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", run.replace(
            "curl -s", "curl --fail-with-body -s")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert '"error"' not in text
    dec = json.JSONDecoder()
    objs, i = [], 0
    while i < len(text):  # the JSON answers and the SSE lines, in order
        if text.startswith("data: ", i):
            j = text.index("\n", i)
            objs.append(("sse", text[i + 6:j]))
            i = j + 1
        elif text[i].isspace():
            i += 1
        else:
            o, i = dec.raw_decode(text, i)
            objs.append(("json", o))
    kinds = [o.get("object") if k == "json" else "sse" for k, o in objs]
    assert kinds[0] == "list" and objs[0][1]["data"][0]["id"] == "default"
    assert kinds[1] == "chat.completion" and objs[1][1]["choices"][0]["message"]["content"]
    sse = [o for k, o in objs if k == "sse"]
    assert sse[-1] == "[DONE]" and json.loads(sse[-2])["usage"]["total_tokens"] > 0
    completion = objs[len(sse) + 2][1]
    assert completion["object"] == "text_completion" and completion["choices"][0]["logprobs"]
    assert objs[-1][1] == {"status": "ok", "model": "default"}
    assert re.search(r'"model": "default"', DOC.read_text())


STRUCTURED_DOC = DOC.parent / "structured-outputs.md"


def _python_block(doc: Path, name: str) -> str:
    text = doc.read_text()
    block = text.split(f"<!-- {name}:start -->", 1)[1].split(f"<!-- {name}:end -->")[0]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("doc, name", [(STRUCTURED_DOC, "structured-examples"),
                                       (DOC, "http-python-examples")])
def test_python_doc_examples_work_as_written(tools_artifact, doc, name):
    """The openai-client examples of docs/structured-outputs.md and docs/http-api.md, run as
    written against a random-init model with a Hermes-style template served as `default`
    (only localhost:8000 becomes the test server's address)."""
    pytest.importorskip("openai")
    code = _python_block(doc, name)
    assert "localhost:8000" in code
    with running_app(tools_artifact, http_port=0, served_model_name="default") as app:
        code = code.replace("localhost:8000", f"127.0.0.1:{app.http_port}")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip(), "the examples print what they got"

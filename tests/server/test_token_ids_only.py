"""An artifact without tokenizer.json (an imported model that came without one) passes verify
and is served with token ids only: id prompts generate and score as usual, and every RPC that
needs text answers FAILED_PRECONDITION saying the model has no tokenizer."""
from __future__ import annotations

import shutil

import grpc
import pytest

from kvserve_testing import (collect, gen_request, read_manifest, running_app, torch_generate,
                             torch_logprobs, write_manifest)


@pytest.fixture(scope="module")
def ids_only(artifact, tmp_path_factory):
    from kvserve.artifact.verify import verify_artifacts

    root = tmp_path_factory.mktemp("ids-only") / "artifact"
    shutil.copytree(artifact.dir, root)
    (root / "tokenizer.json").unlink()
    m = read_manifest(root)
    del m["files"]["tokenizer.json"]
    write_manifest(root, m)
    verify_artifacts(root)  # what `kvserve verify` runs: it passes
    with running_app(type(artifact)(root, artifact.model, None, artifact.cfg),
                     http_port=0) as app:
        ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
        from kvserve.v1 import inference_pb2_grpc

        yield app, inference_pb2_grpc.InferenceStub(ch)
        ch.close()


def test_token_id_prompts_generate_and_score(ids_only, artifact):
    from kvserve.v1 import inference_pb2 as pb

    app, stub = ids_only
    prompt = [5, 17, 42, 99, 7]
    chunks, done = collect(stub.Generate(gen_request(prompt, 12, logprobs=True,
                                                     top_logprobs=2)))
    assert [c.id for c in chunks] == torch_generate(artifact.model, prompt, 12)
    assert all(c.text == "" for c in chunks) and done.text == ""
    assert done.generated_tokens == 12 and done.prompt_tokens == len(prompt)
    r = stub.Score(pb.ScoreRequest(token_ids=[pb.TokenIds(ids=prompt)]))
    got = [t.logprob for t in r.sequences[0].tokens]
    assert got == pytest.approx(torch_logprobs(artifact.model, prompt).tolist(), abs=1e-4)
    assert stub.ModelInfo(pb.ModelInfoRequest()).vocab_size == artifact.cfg.vocab_size


@pytest.mark.parametrize("call, what", [
    ("generate_text", "a text prompt"),
    ("generate_stop", "a stop string (use stop_token_ids)"),
    ("score_text", "a text prompt"),
    ("tokenize", "Tokenize"),
    ("detokenize", "Detokenize"),
])
def test_text_rpcs_fail_precondition(ids_only, call, what):
    from kvserve.v1 import inference_pb2 as pb

    _, stub = ids_only
    calls = {
        "generate_text": lambda: collect(stub.Generate(gen_request("def f():", 4))),
        "generate_stop": lambda: collect(stub.Generate(gen_request([1, 2, 3], 4, stop=["\n"]))),
        "score_text": lambda: stub.Score(pb.ScoreRequest(texts=["x = 1"])),
        "tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(texts=["x"])),
        "detokenize": lambda: stub.Detokenize(pb.DetokenizeRequest(
            token_ids=[pb.TokenIds(ids=[1, 2])])),
    }
    with pytest.raises(grpc.RpcError) as e:
        calls[call]()
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert e.value.details() == (f"{what} needs a tokenizer and this model has none (its "
                                 f"artifact has no tokenizer.json): send token ids")



@pytest.mark.parametrize("body, status, what", [
    ({"prompt": "def f():", "max_tokens": 4}, 400, "a text prompt"),
    ({"prompt": [1, 2, 3], "max_tokens": 2, "echo": True, "logprobs": 1}, 400,
     "echo of a token-id prompt"),
    ({"prompt": [1, 2, 3], "max_tokens": 2, "stop": ["\n"]}, 400, "stop"),
    # (greedy, past the end-of-text token: OpenAI's default temperature 1 drew it now and then,
    # 4 of 300 requests, and the completion ended after 1 token)
    ({"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "ignore_eos": True}, 200, None),
], ids=["text", "echo-ids", "stop-string", "ids"])
def test_http_text_needs_the_tokenizer(ids_only, body, status, what):
    """Over HTTP as over gRPC: a 400 saying the model has no tokenizer, never a 500."""
    import json
    import urllib.error
    import urllib.request

    app, _ = ids_only
    req = urllib.request.Request(f"http://127.0.0.1:{app.http_port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            got, out = r.status, json.load(r)
    except urllib.error.HTTPError as e:
        got, out = e.code, json.load(e)
    assert got == status, out
    if what is not None:
        msg = out["error"]["message"]
        assert what in msg and "needs a tokenizer" in msg, msg
    else:
        assert out["usage"]["completion_tokens"] == 2

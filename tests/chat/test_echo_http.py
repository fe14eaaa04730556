"""Evaluation interop over HTTP: /v1/completions ``echo`` returns the prompt's tokens with
their logprobs (the first null) and top logprobs, for ``max_tokens`` 0 and more, as vLLM does;
vLLM's ``prompt_logprobs``; the tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info).
References: the torch model's own logprobs of the same ids."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from chat_helpers import TOKEN
from kvserve_testing import torch_logprobs

openai = pytest.importorskip("openai")
PROMPT = "def add(a, b):\n    return"
TOL = 2e-4  # onnxruntime fp32 vs torch fp32, per token logprob


def _post(app, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{app.http_port}{path}",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {TOKEN}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_echo_max_tokens_0_is_the_prompt_scored(tools_oai, tools_artifact):
    ids = tools_artifact.tokenizer.encode(PROMPT)
    ref = torch_logprobs(tools_artifact.model, ids)
    for prompt in (PROMPT, ids):
        r = tools_oai.completions.create(model="artifact", prompt=prompt, echo=True, logprobs=2,
                                         max_tokens=0)
        c = r.choices[0]
        assert c.text == PROMPT and c.finish_reason == "length"
        lp = c.logprobs
        assert "".join(lp.tokens) == PROMPT and len(lp.tokens) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:], ref, atol=TOL)
        for k, tops in enumerate(lp.top_logprobs[1:], 1):
            assert 2 <= len(tops) <= 3 and tops[lp.tokens[k]] == lp.token_logprobs[k]
            assert max(tops.values()) >= lp.token_logprobs[k]
        assert lp.text_offset == [sum(map(len, lp.tokens[:k])) for k in range(len(ids))]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)


def test_echo_of_prompts_sharing_a_context(tools_app, tools_oai, tools_artifact):
    """lm-evaluation-harness's multiple choice in one request (a prompt list, echo,
    max_tokens 0): a context with four continuations, scored with the shared tokens once
    (server.scoring), each choice the torch model's own logprobs."""
    tok = tools_artifact.tokenizer
    context = tok.encode("def add(a, b):\n    return a + b\n\n" * 3 + "print(add(")
    assert len(context) >= 16
    prompts = [context + tok.encode(c) for c in ("1, 2))", "3, 4)", "a, b)", "x")]
    assert tools_app.engine.score_shares
    r = tools_oai.completions.create(model="artifact", prompt=prompts, echo=True, logprobs=1,
                                     max_tokens=0)
    assert len(r.choices) == 4
    for c in r.choices:
        ids = prompts[c.index]
        assert c.logprobs.token_logprobs[0] is None
        np.testing.assert_allclose(c.logprobs.token_logprobs[1:],
                                   torch_logprobs(tools_artifact.model, ids), atol=TOL)
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    # the same context again, a request a prompt: its whole blocks from the prefix cache
    # (the last of their tokens fed again), in the usage's cached tokens
    for p in prompts[:2]:
        r = tools_oai.completions.create(model="artifact", prompt=p, echo=True, logprobs=1,
                                         max_tokens=0)
        np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs[1:],
                                   torch_logprobs(tools_artifact.model, p), atol=TOL)
        assert r.usage.prompt_tokens_details.cached_tokens == len(context) // 16 * 16 - 1


def test_echo_with_generation_appends_the_reply(tools_oai, tools_artifact):
    ids = tools_artifact.tokenizer.encode(PROMPT)
    kw = dict(model="artifact", prompt=PROMPT, logprobs=1, max_tokens=4, temperature=0)
    plain = tools_oai.completions.create(**kw).choices[0]
    c = tools_oai.completions.create(echo=True, **kw).choices[0]
    assert c.text == PROMPT + plain.text
    lp = c.logprobs
    assert len(lp.token_logprobs) == len(ids) + 4  # the end token too, were it generated
    assert lp.token_logprobs[len(ids):] == plain.logprobs.token_logprobs
    assert lp.text_offset[len(ids)] == len(PROMPT)
    # streamed: the prompt first, then the reply
    chunks = list(tools_oai.completions.create(echo=True, stream=True, **kw))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text


def test_vllm_prompt_logprobs(tools_oai, tools_artifact):
    ids = tools_artifact.tokenizer.encode(PROMPT)
    ref = torch_logprobs(tools_artifact.model, ids)
    r = tools_oai.completions.create(model="artifact", prompt=PROMPT, max_tokens=1,
                                     extra_body={"prompt_logprobs": 3})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for k, entry in enumerate(plp[1:], 1):
        own = entry[str(ids[k])]
        assert abs(own["logprob"] - ref[k - 1]) < TOL
        ranked = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"])
        assert [rk for rk, _ in ranked] == [1, 2, 3]
        assert all(a[1] >= b[1] for a, b in zip(ranked, ranked[1:]))


def test_tokenizer_endpoints(tools_app, tools_artifact):
    tok = tools_artifact.tokenizer
    got = _post(tools_app, "/tokenize", {"prompt": PROMPT})
    assert got["tokens"] == tok.encode(PROMPT, add_special_tokens=True)
    assert got["count"] == len(got["tokens"])
    assert _post(tools_app, "/detokenize", {"tokens": got["tokens"]})["prompt"] == PROMPT
    info = _post(tools_app, "/tokenizer_info", None)
    assert info["eos_token"] == "<|im_end|>"
    assert info["eos_token_id"] == tok.token_to_id("<|im_end|>")

"""The OpenAI-compatible HTTP API driven by the official openai client: models, chat and text
completions (streamed and not), logprobs, stop, seed, n; a greedy chat completion is the gRPC
Generate of the same rendered prompt token for token; 16 HTTP streams share the batch with gRPC
streams."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from kvserve.v1 import inference_pb2 as pb

from chat_helpers import AUTH, TOKEN
from kvserve_testing import CHATML_TEMPLATE, collect, gen_request

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def add(a, b):"}]


def rendered_ids(tok, messages):
    """The prompt as transformers renders and tokenizes it (the reference)."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok.to_str()),
                                              chat_template=CHATML_TEMPLATE,
                                              eos_token="<|im_end|>")
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_models_and_health(oai, base_url, chat_app):
    models = oai.models.list()
    assert [m.id for m in models.data] == ["artifact"]
    assert oai.models.retrieve("artifact").owned_by == "kvserve"
    with urllib.request.urlopen(base_url + "/health") as r:  # no token needed
        assert json.load(r)["status"] == "ok"


def test_greedy_chat_equals_grpc_generate(oai, chat_stub, chat_artifact):
    r = oai.chat.completions.create(model="artifact", messages=MESSAGES, max_tokens=12,
                                    temperature=0, logprobs=True, top_logprobs=2)
    ids = rendered_ids(chat_artifact.tokenizer, MESSAGES)
    chunks, done = collect(chat_stub.Generate(
        gen_request(ids, 12, ignore_eos=False, logprobs=True, top_logprobs=2), metadata=AUTH))
    plain = [c for c in chunks if not c.special]
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == done.text
    got_tokens = [bytes(t.bytes) for t in choice.logprobs.content]
    assert got_tokens == [bytes(_token_bytes(chat_artifact, c.id)) for c in plain]
    assert [c.id for c in plain]  # the model said something
    for t, c in zip(choice.logprobs.content, plain):
        assert t.logprob == pytest.approx(c.logprob, abs=1e-5)
        assert len(t.top_logprobs) == 2
    assert r.usage.prompt_tokens == len(ids) == done.prompt_tokens
    assert r.usage.completion_tokens == done.generated_tokens
    assert choice.finish_reason == ("length" if done.finish_reason == pb.FINISH_REASON_LENGTH
                                    else "stop")
    # the gRPC chat prompt renders the same ids, so the same tokens
    req = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(**m) for m in MESSAGES]),
                             stopping=pb.StoppingOptions(max_new_tokens=12))
    chunks2, done2 = collect(chat_stub.Generate(req, metadata=AUTH))
    assert [c.id for c in chunks2] == [c.id for c in chunks] and done2.prompt_tokens == len(ids)


def _token_bytes(art, i):
    from tokenizers import Tokenizer as HFTokenizer

    from kvserve.server.detok import TokenBytes
    return TokenBytes(HFTokenizer.from_str(art.tokenizer.to_str()), art.cfg.vocab_size)[i]


def test_chat_stream_with_usage(oai):
    whole = oai.chat.completions.create(model="artifact", messages=MESSAGES, max_tokens=10,
                                        temperature=0)
    stream = oai.chat.completions.create(model="artifact", messages=MESSAGES, max_tokens=10,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    text, finish, usage, first = "", None, None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk" and chunk.id.startswith("chatcmpl-")
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        d = chunk.choices[0].delta
        first = first or d.role
        text += d.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert first == "assistant"
    assert text == whole.choices[0].message.content and finish == whole.choices[0].finish_reason
    assert usage.model_dump() == whole.usage.model_dump()


def test_completions(oai, chat_artifact):
    r = oai.completions.create(model="artifact", prompt="def add(a, b):", max_tokens=8,
                               temperature=0, logprobs=2)
    c = r.choices[0]
    assert r.object == "text_completion" and len(c.logprobs.tokens) == len(
        c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
    assert "".join(c.logprobs.tokens) == c.text or c.finish_reason == "stop"
    ids = chat_artifact.tokenizer.encode("def add(a, b):")
    r2 = oai.completions.create(model="artifact", prompt=ids, max_tokens=8, temperature=0)
    assert r2.choices[0].text == c.text and r2.usage.prompt_tokens == len(ids)
    text = "".join(ch.choices[0].text for ch in oai.completions.create(
        model="artifact", prompt="def add(a, b):", max_tokens=8, temperature=0, stream=True))
    assert text == c.text
    # default max_tokens is OpenAI's 16
    r3 = oai.completions.create(model="artifact", prompt=ids, temperature=0, extra_body={
        "ignore_eos": True})
    assert r3.usage.completion_tokens == 16


def test_sampling_options(oai):
    kw = dict(model="artifact", messages=MESSAGES, max_tokens=8, temperature=1.0, top_p=0.9,
              seed=7, presence_penalty=0.5, frequency_penalty=0.5)
    a = oai.chat.completions.create(**kw)
    b = oai.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    many = oai.chat.completions.create(**{**kw, "n": 3})
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].message.content == a.choices[0].message.content
    assert many.usage.prompt_tokens == a.usage.prompt_tokens
    greedy = oai.completions.create(model="artifact", prompt="for i in", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    text = greedy.choices[0].text
    if len(text) > 4:
        stop = text[2:4]
        s = oai.completions.create(model="artifact", prompt="for i in", max_tokens=12,
                                   temperature=0, stop=[stop], extra_body={"ignore_eos": True})
        assert s.choices[0].finish_reason == "stop"
        assert s.choices[0].text == text[:text.index(stop)]


def test_every_eos_id_stops(chat_app, chat_artifact, chat_stub):
    tok = chat_artifact.tokenizer
    info = chat_stub.ModelInfo(pb.ModelInfoRequest(), metadata=AUTH)
    assert info.chat_template_available
    assert set(info.eos_token_ids) == {tok.eos_id, tok.token_to_id("<|im_end|>")}
    # the engine stops on each of them: make the model's 3rd greedy token an EOS id (a prompt
    # whose first two greedy tokens are neither that token nor an EOS id: the random model
    # often repeats one token)
    engine = chat_app.engine
    saved = engine.eos_ids
    for prompt in ("for i in", "def add(a, b):", "class Point:", "naïve café", "x = [1, 2]"):
        chunks, _ = collect(chat_stub.Generate(gen_request(prompt, 6), metadata=AUTH))
        third = chunks[2].id
        if third not in saved and not {c.id for c in chunks[:2]} & (saved | {third}):
            break
    else:
        pytest.fail("no prompt whose greedy answer starts with 3 distinct non-EOS tokens")
    engine.eos_ids = saved | {third}
    try:
        chunks, done = collect(chat_stub.Generate(gen_request(prompt, 6, ignore_eos=False),
                                                  metadata=AUTH))
    finally:
        engine.eos_ids = saved
    assert done.finish_reason == pb.FINISH_REASON_EOS_TOKEN and len(chunks) == 3


def test_http_and_grpc_streams_share_the_batch(oai, chat_app, chat_stub, monkeypatch):
    """16 HTTP streams and 4 gRPC streams at once: each gets its own greedy answer (as when
    alone), and the engine decodes them together (max_batch 8 running at once)."""
    # one token a step, so that the 96-token streams overlap on a loaded machine (accepted
    # drafts ended this random model's loops in a few steps: a batch of 5, not 8, was seen)
    monkeypatch.setattr(chat_app.engine.runner, "spec", None)
    prompts = [f"# doc {i}\n" for i in range(16)]
    n = 96  # long enough for the 20 streams to overlap
    alone = {p: oai.completions.create(model="artifact", prompt=p, max_tokens=n, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
             for p in prompts[:4]}
    results, errors, peak = {}, [], [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], chat_app.engine.load()["running"])
            time.sleep(0.002)

    def http(i):
        try:
            s = oai.completions.create(model="artifact", prompt=prompts[i], max_tokens=n,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
            results[("http", i)] = "".join(c.choices[0].text for c in s)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def grpc_(i):
        try:
            _, done = collect(chat_stub.Generate(gen_request(prompts[i], n), metadata=AUTH))
            results[("grpc", i)] = done.text
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    w = threading.Thread(target=watch)
    w.start()
    threads = [threading.Thread(target=http, args=(i,)) for i in range(16)] + \
        [threading.Thread(target=grpc_, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    w.join()
    assert not errors and len(results) == 20
    for p in range(4):
        assert results[("http", p)] == results[("grpc", p)] == alone[prompts[p]]
    assert peak[0] == 8  # the batch was full: HTTP and gRPC sequences decoded together


def test_auth_and_unknown_model(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.models.list()
    assert e.value.status_code == 401 and "invalid credentials" in str(e.value)
    req = urllib.request.Request(base_url + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 401 and "Bearer" in json.load(e.value)["error"]["message"]
    with openai.OpenAI(base_url=base_url + "/v1", api_key=TOKEN, max_retries=0) as c:
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert e.value.status_code == 404 and "gpt-4o" in e.value.body["message"]


def test_usage_reports_the_cached_prompt_tokens(oai, chat_stub, chat_artifact):
    """The same chat sent again: its prompt's rows are cached, so usage reports them, over HTTP
    (``prompt_tokens_details.cached_tokens``) and over gRPC (``cached_prompt_tokens``): every
    prompt token but the last where the slot the first one left kept its rows (an idle
    server: always), its whole 16-token blocks at least (the pool)."""
    ids = rendered_ids(chat_artifact.tokenizer, MESSAGES)
    assert len(ids) > 16
    blocks = (len(ids) - 1) // 16 * 16
    first = oai.chat.completions.create(model="artifact", messages=MESSAGES, max_tokens=3,
                                        temperature=0)
    again = oai.chat.completions.create(model="artifact", messages=MESSAGES, max_tokens=3,
                                        temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == len(ids)
    assert again.usage.prompt_tokens_details.cached_tokens in (len(ids) - 1, blocks)
    _, done = collect(chat_stub.Generate(gen_request(ids, 3), metadata=AUTH))
    assert done.cached_prompt_tokens in (len(ids) - 1, blocks)
    assert again.choices[0].message.content == first.choices[0].message.content


def test_grpc_chat_template_kwargs_nested_too_deeply_is_invalid_argument(chat_stub):
    import grpc

    from kvserve.v1 import inference_pb2 as pb
    req = pb.GenerateRequest(stopping=pb.StoppingOptions(max_new_tokens=2))
    req.chat.messages.add(role="user", content="hi")
    req.chat.chat_template_kwargs = "[" * 100_000 + "]" * 100_000
    with pytest.raises(grpc.RpcError) as e:
        collect(chat_stub.Generate(req, metadata=AUTH, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.chat_template_kwargs nests too deeply" in e.value.details()


def test_prediction_and_prompt_cache_hints(oai, base_url):
    """OpenAI's ``prediction`` (a source of n-gram drafts: the reply, a seeded sampled one
    here, is the same with it; tests/server/test_speedups.py counts the drafts it gives) and
    its prompt-caching hints and ``include_obfuscation`` (accepted, no effect); bad shapes are
    400 naming the field."""
    openai = pytest.importorskip("openai")
    kw = dict(model="artifact", messages=MESSAGES, max_tokens=24, temperature=1.0, seed=5)
    first = oai.chat.completions.create(**kw)
    plain = first.choices[0].message.content
    assert plain
    details = first.usage.completion_tokens_details  # no prediction: nothing drafted from one
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    got = oai.chat.completions.create(**kw, prediction={"type": "content", "content": plain},
                                      prompt_cache_key="k1", prompt_cache_retention="24h")
    assert got.choices[0].message.content == plain
    # (how many are drafted depends on the speculator's weighing on this machine: the engine's
    # counts are tested in tests/server/test_speedups.py)
    details = got.usage.completion_tokens_details
    assert 0 <= details.accepted_prediction_tokens <= got.usage.completion_tokens
    assert details.rejected_prediction_tokens >= 0
    parts = oai.chat.completions.create(**kw, prediction={
        "type": "content", "content": [{"type": "text", "text": plain[:5]},
                                       {"type": "text", "text": plain[5:]}]})
    assert parts.choices[0].message.content == plain
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={
        "include_usage": True, "include_obfuscation": False}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    for bad_value in ({"type": "text", "content": "x"}, {"type": "content", "content": 3},
                      {"type": "content", "content": [{"type": "image_url"}]}, "x"):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(**kw, prediction=bad_value)
        assert e.value.body["param"] == "prediction"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**kw, prompt_cache_key=7)
    assert e.value.body["param"] == "prompt_cache_key"

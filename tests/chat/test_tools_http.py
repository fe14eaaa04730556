"""Tool calling on /v1/chat/completions through the official ``openai`` client, on a
random-init model with a Hermes/Qwen-style template: ``tool_choice`` "required" and a named
function constrain the reply to a valid call (arguments valid under the tool's schema),
streamed as OpenAI streams tool-call deltas; "auto" parses what the model writes; "none"
parses nothing; tool messages render as transformers renders them; and the template's own
options (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``)."""
from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

from tools_artifact import HERMES_TEMPLATE  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(chunks) -> tuple[dict, str, str]:
    """({index: {id, name, arguments}}, content, finish_reason) from streamed chunks."""
    calls: dict[int, dict] = {}
    content, reason = "", None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                assert c["id"] is None  # the id and the name come once, first
                c["id"], c["name"] = tc.id, tc.function.name
            c["arguments"] += tc.function.arguments or ""
        reason = ch.choices[0].finish_reason or reason
    return calls, content, reason


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)],
                         ids=["greedy", "sampled"])
def test_required_returns_a_valid_call(tools_oai, sampling):
    kw = dict(model="artifact", messages=MSGS, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, max_tokens=160, **sampling)
    c = tools_oai.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls", c
    assert len(c.message.tool_calls) == 1 and c.message.content is None
    _valid(c.message.tool_calls[0])
    calls, content, reason = _streamed(tools_oai.chat.completions.create(stream=True, **kw))
    assert reason == "tool_calls" and content == "" and len(calls) == 1
    got = calls[0]
    assert got["id"].startswith("call_")
    jsonschema.validate(json.loads(got["arguments"]), SCHEMAS[got["name"]])
    if sampling.get("temperature") == 0 or "seed" in sampling:  # the same call, streamed
        want = c.message.tool_calls[0].function
        assert (got["name"], json.loads(got["arguments"])) == (want.name,
                                                               json.loads(want.arguments))


def test_a_reply_cut_off_mid_call_streams_as_it_answers(tools_oai):
    """max_tokens ending inside the last call: streamed and not, the same calls (the complete
    ones before the cut), the same content (the cut block as written) and finish "length"."""
    kw = dict(model="artifact", messages=MSGS, tools=TOOLS, tool_choice="required",
              temperature=0)
    whole = tools_oai.chat.completions.create(max_tokens=300, logprobs=True, **kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    toks = [x.token for x in whole.choices[0].logprobs.content]
    blocks = "".join(toks).count("<tool_call>")
    opened = next(k for k in range(len(toks) + 1)
                  if "".join(toks[:k]).count("<tool_call>") == blocks)
    kw["max_tokens"] = opened + 3  # a few tokens into the last call
    assert kw["max_tokens"] < len(toks) - 3
    c = tools_oai.chat.completions.create(**kw).choices[0]
    calls, content, reason = _streamed(tools_oai.chat.completions.create(stream=True, **kw))
    assert c.finish_reason == reason == "length"
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []] == \
        [(x["name"], x["arguments"]) for _, x in sorted(calls.items())]
    assert (c.message.content or "").strip() == content.strip() and "<tool_call>" in content
    assert len(calls) == len(whole.choices[0].message.tool_calls) - 1


def test_named_function_is_the_one_called(tools_oai):
    for name in ("get_time", "get_weather"):
        r = tools_oai.chat.completions.create(
            model="artifact", messages=MSGS, tools=TOOLS, max_tokens=160, temperature=0.8, seed=3,
            n=2, tool_choice={"type": "function", "function": {"name": name}})
        for c in r.choices:
            assert c.finish_reason == "tool_calls"
            assert [t.function.name for t in c.message.tool_calls] == [name]
            _valid(c.message.tool_calls[0])


def _call_grammar(tok) -> str:
    """A Lark grammar whose only sentences are a Hermes call of get_time, its markers the
    added tokens (as a real model writes them): a reply "auto" must find the call in."""
    o, c = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    return (f'start: <[{o}]> "\\n{{\\"name\\": \\"get_time\\", \\"arguments\\": '
            f'{{\\"zone\\": \\"" ZONE "\\"}}}}\\n" <[{c}]>\nZONE: "UTC" | "CET"')


def test_auto_parses_what_the_model_writes(tools_oai, tools_artifact):
    grammar = _call_grammar(tools_artifact.tokenizer)
    kw = dict(model="artifact", messages=MSGS, tools=TOOLS, max_tokens=64, temperature=0,
              extra_body={"structured_outputs": {"grammar": grammar}})
    c = tools_oai.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.tool_calls[0].function.name == "get_time"
    _valid(c.message.tool_calls[0])
    calls, content, reason = _streamed(tools_oai.chat.completions.create(stream=True, **kw))
    assert reason == "tool_calls" and content == ""
    assert json.loads(calls[0]["arguments"]) == json.loads(
        c.message.tool_calls[0].function.arguments)
    # "none": the same text stays content (the added tokens' text kept)
    c = tools_oai.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.content.startswith("<tool_call>\n{") and \
        c.message.content.endswith("</tool_call>")


def _reference_ids(tokenizer, messages, **kw) -> list[int]:
    from tokenizers import Tokenizer as HFTokenizer

    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer.from_str(tokenizer.to_str()), chat_template=HERMES_TEMPLATE,
        eos_token="<|im_end|>")
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


CONVERSATION = MSGS + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny"}]


@pytest.mark.parametrize("body, kw", [
    (dict(tools=TOOLS), dict(tools=TOOLS, add_generation_prompt=True)),
    (dict(add_generation_prompt=False), dict(add_generation_prompt=False)),
    (dict(continue_final_message=True), dict(continue_final_message=True)),
    (dict(chat_template_kwargs={"enable_thinking": False}, add_generation_prompt=True),
     dict(add_generation_prompt=True, enable_thinking=False)),
], ids=["tools", "no-generation-prompt", "continue", "template-kwargs"])
def test_prompt_renders_as_transformers(tools_oai, tools_artifact, body, kw):
    """The server's prompt (its token count and its echo-free usage) is transformers'
    apply_chat_template(...) of the same conversation, tool calls and results included."""
    messages = CONVERSATION if "continue_final_message" in body else CONVERSATION[:-1]
    ref_messages = json.loads(json.dumps(messages))
    for m in ref_messages:  # transformers' templates get the arguments as an object
        for tc in m.get("tool_calls") or []:
            tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
        if m["content"] is None:
            m["content"] = ""
    want = _reference_ids(tools_artifact.tokenizer, ref_messages, **kw)
    r = tools_oai.chat.completions.create(model="artifact", messages=messages, max_tokens=1,
                                          extra_body={**body, "prompt_logprobs": 0})
    assert r.usage.prompt_tokens == len(want)
    plp = r.model_extra["prompt_logprobs"]
    assert plp[0] is None and all(len(d) == 1 for d in plp[1:])
    got = [int(next(iter(d))) for d in plp[1:]]
    assert got == want[1:]  # the prompt token of each position (prompt_logprobs 0)


def test_grpc_chat_prompt_takes_the_template_options(tools_app, tools_artifact):
    """gRPC ChatPrompt.continue_final_message and chat_template_kwargs render as
    transformers' apply_chat_template does (the prompt's token count)."""
    import grpc

    from chat_helpers import AUTH
    from kvserve.v1 import inference_pb2 as pb
    from kvserve.v1 import inference_pb2_grpc as pb_grpc
    from kvserve_testing import collect, ready_channel

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello th"}]
    cases = [(dict(continue_final_message=True), msgs, dict(continue_final_message=True)),
             (dict(chat_template_kwargs='{"enable_thinking": false}'), msgs[:1],
              dict(add_generation_prompt=True, enable_thinking=False))]
    with ready_channel(tools_app.port) as ch:
        stub = pb_grpc.InferenceStub(ch)
        for fields, messages, kw in cases:
            req = pb.GenerateRequest(chat=pb.ChatPrompt(
                messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                          for m in messages], **fields),
                stopping=pb.StoppingOptions(max_new_tokens=1))
            _, done = collect(stub.Generate(req, metadata=AUTH, timeout=60))
            want = _reference_ids(tools_artifact.tokenizer, messages, **kw)
            assert done.prompt_tokens == len(want), fields
        bad = pb.GenerateRequest(chat=pb.ChatPrompt(
            messages=[pb.ChatMessage(role="user", content="hi")], chat_template_kwargs="[1"),
            stopping=pb.StoppingOptions(max_new_tokens=1))
        with pytest.raises(grpc.RpcError) as e:
            collect(stub.Generate(bad, metadata=AUTH, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat_template_kwargs" in e.value.details()



def test_streamed_call_with_logprobs(tools_oai):
    """Logprobs stream for every generated token while the call's text is held back for the
    parser (chunks with an empty delta carry them)."""
    chunks = list(tools_oai.chat.completions.create(
        model="artifact", messages=MSGS, tools=TOOLS, max_tokens=160, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=True,
        logprobs=True, top_logprobs=2, stream_options={"include_usage": True}))
    calls, content, reason = _streamed(chunks)
    assert reason == "tool_calls" and content == "" and calls[0]["name"] == "get_time"
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME)
    lps = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
           for e in ch.choices[0].logprobs.content]
    used = chunks[-1].usage.completion_tokens
    assert used - 1 <= len(lps) <= used  # every token but an end token
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lps)


def test_a_constraint_that_cannot_go_on_ends_its_own_request_only(tools_oai):
    """A regex spelling an added token's content ('<tool_call>') as text: llguidance's mask
    allows only the added token and its matcher then refuses it. That request gets a 400
    saying why; a request running beside it completes."""
    import concurrent.futures

    import openai

    free = dict(model="artifact", prompt="def f(x):", max_tokens=24, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(tools_oai.completions.create, **free)
        with pytest.raises(openai.BadRequestError) as e:
            tools_oai.completions.create(model="artifact", prompt="x", max_tokens=8,
                                         extra_body={"structured_outputs":
                                                     {"regex": "<tool_call>[a-z]+"}})
        assert "added tokens" in str(e.value)
        assert "is not allowed by the regex constraint" in str(e.value)  # the matcher's reason
        assert other.result().choices[0].finish_reason == "length"

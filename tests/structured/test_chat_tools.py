"""Chats with tools render exactly as transformers' apply_chat_template (the real Qwen3
template): tools, assistant tool_calls (arguments sent as a JSON string, as OpenAI clients
do), tool results, chat_template_kwargs (enable_thinking); bad messages are refused."""
from __future__ import annotations

import json

import pytest

from kvserve.model.tokenizer import Tokenizer
from kvserve.server.chat_template import ChatTemplate
from kvserve.server.config import ServerConfig
from kvserve.server.domain import InvalidArgument
from kvserve.server.prompts import Prompts
from kvserve.server.validation import Limits

transformers = pytest.importorskip("transformers")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT = [{"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    cfg = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(qwen3_dir / "tokenizer.json")
    lim = Limits.make(ServerConfig(), tok.vocab_size, 1, 1, 4096)
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen3_dir), local_files_only=True)
    return Prompts(tok, lim, ChatTemplate.from_tokenizer_config(cfg)), ref


def _for_transformers(chat):
    """What vLLM hands transformers: the arguments string parsed, a call's null content "" (the
    Qwen3 template concatenates it: transformers itself fails on None)."""
    out = []
    for m in chat:
        m = dict(m)
        if m.get("tool_calls"):
            m["content"] = m.get("content") or ""
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("upto", [2, 4])
def test_tools_render_as_transformers(qwen3, kwargs, upto):
    ours, ref = qwen3
    chat = CHAT[:upto]
    got = ours.render(chat, tools=TOOLS, template_kwargs=kwargs)
    want = ref.apply_chat_template(_for_transformers(chat), tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True, **kwargs)
    assert got == want
    assert "<tools>" in got and ('"name": "get_weather"' in got)
    if upto == 4:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in got
        assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in got
    ids = ours.chat(chat, tools=TOOLS, template_kwargs=kwargs)
    assert ids == ref(want, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("msg, message", [
    ({"role": "assistant", "content": None}, r"messages\[0\]\.content must be a string"),
    ({"role": "user", "content": "x", "audio": {}}, "unsupported fields: audio"),
    ({"role": "assistant", "content": "x", "tool_calls": []}, "must be a list of 1 to 64"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
     r"tool_calls\[0\]\.function\.arguments is not valid JSON"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "must be a JSON object"),
    ({"role": "assistant", "tool_calls": [{"type": "function"}]}, r"tool_calls\[0\] must be"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, "tool_call_id must be a string"),
])
def test_bad_messages(qwen3, msg, message):
    ours, _ = qwen3
    with pytest.raises(InvalidArgument, match=message):
        ours.render([msg])


@pytest.mark.parametrize("kw, message", [
    ([1], "chat_template_kwargs must be an object"),
    ({"messages": []}, "chat_template_kwargs.messages is set by the server"),
    ({"not a name": 1}, "is not a template variable name"),
    ({f"k{i}": 1 for i in range(33)}, "the limit is 32"),
    ({"big": "x" * 20_000}, "over 16384 characters"),
])
def test_bad_template_kwargs(qwen3, kw, message):
    ours, _ = qwen3
    with pytest.raises(InvalidArgument, match=message):
        ours.render([("user", "hi")], template_kwargs=kw)


def test_tool_call_characters_count_toward_the_chat_limit(qwen3):
    ours, _ = qwen3
    lim = Limits.make(ServerConfig(max_chat_chars=100), ours.lim.vocab_size, 1, 1, 4096)
    small = Prompts(ours.tok, lim, ours.template)
    big = {"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": json.dumps({"a": "x" * 200})}}]}
    with pytest.raises(InvalidArgument, match="the limit is 100"):
        small.render([big])

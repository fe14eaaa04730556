"""server/tool_calls.py: format detection, tools/tool_choice checks, the required/named
constraint (random logits on the real Qwen3 tokenizer and a trained BPE always give a valid
call), and the parsers' exact outputs, malformed output left as content."""
from __future__ import annotations

import itertools
import json

import pytest

from decoding import RandomModel, generate
from kvserve.server.domain import InvalidArgument
from kvserve.server.tool_calls import (ToolFormat, added_token_ids, check_tool_choice,
                                       check_tools,
                                       detect_format, finish_reason, new_call_id, parse_tool_calls,
                                       tool_constraint)

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object",
                                  "properties": {"a": {"type": "integer", "maximum": 999},
                                                 "b": {"type": "integer", "minimum": -9}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
LLAMA31_SNIPPET = ('Given the following functions, please respond with a JSON for a function '
                   'call with its proper arguments that best answers the given prompt.\\n\\n'
                   'Respond in the format {"name": function name, "parameters": dictionary of '
                   'argument name and its value}.Do not use variables.')
MISTRAL_SNIPPET = ("{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- for tool_call in "
                   "message.tool_calls %}")


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def test_detect_format(qwen3_dir):
    qwen3 = json.loads((qwen3_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert detect_format(qwen3) is ToolFormat.HERMES
    assert detect_format(LLAMA31_SNIPPET) is ToolFormat.LLAMA3_JSON
    assert detect_format("{{ '<|python_tag|>' }}") is ToolFormat.LLAMA3_JSON
    assert detect_format(MISTRAL_SNIPPET) is ToolFormat.MISTRAL
    from kvserve_testing import CHATML_TEMPLATE, LLAMA3_TEMPLATE

    assert detect_format(CHATML_TEMPLATE) is None and detect_format(LLAMA3_TEMPLATE) is None
    assert detect_format(None) is None


def test_call_ids_are_openai_shaped():
    a, b = new_call_id(), new_call_id()
    assert a != b and a.startswith("call_") and len(a) == 29 and a[5:].isalnum()


@pytest.mark.parametrize("tools, message", [
    ([], "tools must be a non-empty list"),
    ({"type": "function"}, "tools must be a non-empty list"),
    ([{"type": "retrieval"}], r'tools\[0\]\.type must be "function"'),
    ([{"type": "function"}], r"tools\[0\]\.function must be an object"),
    ([{"type": "function", "function": {"name": "a b"}}], r"tools\[0\]\.function\.name must"),
    ([WEATHER, WEATHER], r"tools\[1\]\.function\.name 'get_weather' is given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}],
     r"tools\[0\]\.function\.parameters must be a JSON schema"),
    ([ADD] * 129, "the limit is 128"),
])
def test_bad_tools(tools, message):
    with pytest.raises(InvalidArgument, match=message):
        check_tools(tools)


def test_tool_choice():
    tools = check_tools(TOOLS)
    assert [check_tool_choice(c, tools) for c in (None, "none", "auto", "required")] == \
        ["auto", "none", "auto", "required"]
    assert check_tool_choice({"type": "function", "function": {"name": "add"}}, tools).name == "add"
    with pytest.raises(InvalidArgument, match="tool_choice.function.name 'mul' is not one"):
        check_tool_choice({"type": "function", "function": {"name": "mul"}}, tools)
    with pytest.raises(InvalidArgument, match='tool_choice must be "none"'):
        check_tool_choice("any", tools)
    assert tool_constraint(tools, "auto", ToolFormat.HERMES) is None
    assert tool_constraint(tools, "none", ToolFormat.HERMES) is None


def test_bad_parameters_schema_is_refused_at_constraint_time():
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]
    with pytest.raises(InvalidArgument, match="^tool_choice: .*frob"):
        tool_constraint(check_tools(bad), "required", ToolFormat.HERMES)


def _valid_calls(calls, tools, only=None):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        name = c["function"]["name"]
        assert name in by_name and (only is None or name == only)
        jsonschema.validate(json.loads(c["function"]["arguments"]), by_name[name])


CASES = [(f, choice, par) for f in ToolFormat
         for choice, par in (("required", False), ("required", True), ("add", True))]


@pytest.mark.parametrize("fmt, choice, parallel", CASES,
                         ids=[f"{f.value}-{c}-{'par' if p else 'one'}" for f, c, p in CASES])
def test_constrained_calls_are_valid_qwen3(qwen3_dir, qwen3_guide, fmt, choice, parallel):
    tools = check_tools(TOOLS)
    tc = check_tool_choice(choice if choice == "required" else
                           {"type": "function", "function": {"name": choice}}, tools)
    tj = (qwen3_dir / "tokenizer.json").read_text()
    spec = tool_constraint(tools, tc, fmt, parallel_tool_calls=parallel,
                           added_tokens=added_token_ids(tj))
    for seed, greedy in ((0, True), (1, False)):
        model = RandomModel(tj, qwen3_guide.vocab_size, qwen3_guide.eos_ids, seed)
        text, _, _ = generate(qwen3_guide, spec, model, greedy, fast_forward=seed == 0)
        content, calls = parse_tool_calls(text, fmt)
        assert calls, text
        assert content is None
        if not parallel:
            assert len(calls) == 1
        _valid_calls(calls, TOOLS, only=None if choice == "required" else choice)


def test_constrained_mistral_marker_as_special_token(bpe):
    """Mistral's [TOOL_CALLS] is a control token: the grammar asks for that token."""
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.server.constraints import GuideTokenizer

    hf = type(bpe._tok).from_str(bpe.to_str())
    hf.add_special_tokens(["[TOOL_CALLS]"])
    tok = Tokenizer(hf)
    mark = tok.token_to_id("[TOOL_CALLS]")
    guide = GuideTokenizer(tok.to_str(), tok.vocab_size, [tok.eos_id])
    spec = tool_constraint(check_tools(TOOLS), "required", ToolFormat.MISTRAL,
                           added_tokens=added_token_ids(tok.to_str()))
    c = guide.constraint(spec)
    assert c.forced()[:1] == [mark]
    model = RandomModel(tok.to_str(), tok.vocab_size, guide.eos_ids, seed=4)
    text, out, _ = generate(guide, spec, model, greedy=True, fast_forward=True)
    assert out[0] == mark and text.startswith("[TOOL_CALLS][")
    _valid_calls(parse_tool_calls(text, ToolFormat.MISTRAL)[1], TOOLS)


H = ToolFormat.HERMES
L = ToolFormat.LLAMA3_JSON
M = ToolFormat.MISTRAL
W = {"id": "call_0", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}
A = {"id": "call_1", "type": "function",
     "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
A0 = {**A, "id": "call_0"}


@pytest.mark.parametrize("fmt, text, content, calls", [
    (H, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
        '</tool_call>', None, [W]),
    (H, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
        '\n</tool_call>', "Let me check.", [W, A]),
    (H, '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}', None, [A0]),
    (H, 'no tools here', 'no tools here', []),
    (H, '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>',
     '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>', []),
    (H, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (H, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>\n'
        '{"name": "get_wea', '<tool_call>\n{"name": "get_wea', [A0]),  # the second cut off
    (H, '<tool_call>{"oops"}</tool_call> <tool_call>{"name": "add", "arguments": {"a": 1, '
        '"b": 2}}</tool_call>', '<tool_call>{"oops"}</tool_call>', [A0]),
    (L, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', None, [W]),
    (L, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
        '{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [W, A]),
    (L, 'The answer is {"name": 1}', 'The answer is {"name": 1}', []),
    (L, '{"name": "add", "parameters": [1, 2]}', '{"name": "add", "parameters": [1, 2]}', []),
    (L, '{"name": "add", "parameters": {"a": 1, "b": 2}} trailing',
     '{"name": "add", "parameters": {"a": 1, "b": 2}} trailing', []),
    (M, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
        '{"name": "add", "arguments": {"a": 1, "b": 2}}]', None, [W, A]),
    (M, 'Sure. [TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', "Sure.", [A0]),
    (M, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}',
     '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}', []),
    (M, 'plain answer', 'plain answer', []),
])
def test_parse_exact(fmt, text, content, calls):
    assert parse_tool_calls(text, fmt, ids()) == (content, calls)


def test_parse_keeps_unicode_and_nested_arguments():
    text = ('<tool_call>\n{"name": "f", "arguments": {"q": "日本 \\"x\\"", '
            '"o": {"k": [1, null]}}}\n</tool_call>')
    _, calls = parse_tool_calls(text, H, ids())
    assert calls[0]["function"]["arguments"] == '{"q": "日本 \\"x\\"", "o": {"k": [1, null]}}'


def test_finish_reason_says_a_cut_off_turn():
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"  # the calls before the cut still count
    assert finish_reason("stop", False) == "stop"


@pytest.mark.parametrize("fmt", [H, L, M])
def test_a_reply_nesting_too_deeply_is_content(fmt):
    deep = "[" * 50_000 + "]" * 50_000
    text = {H: f"<tool_call>{deep}</tool_call>",
            L: "{" + f'"name": "f", "parameters": {deep}' + "}",
            M: f"[TOOL_CALLS]{deep}"}[fmt]
    assert parse_tool_calls(text, fmt, ids()) == (text, [])

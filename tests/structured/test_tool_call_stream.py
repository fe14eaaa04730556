"""server/tool_call_stream.py: exact OpenAI deltas for each format, whatever the chunking
(every split of the text gives the same merged result); content passes through; malformed
calls come back as content; the streamed calls equal the non-streamed parse."""
from __future__ import annotations

import itertools

import pytest

from kvserve.server.tool_call_stream import ToolCallStream
from kvserve.server.tool_calls import ToolFormat, parse_tool_calls

H, L, M = ToolFormat.HERMES, ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL
HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
              '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n')


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def run(fmt, chunks):
    s = ToolCallStream(fmt, ids())
    out = []
    for c in chunks:
        out += s.push(c)
    out += s.finish()
    return out, s.calls


def merged(deltas):
    """Consecutive content deltas joined (what a client shows), tool deltas kept."""
    out = []
    for d in deltas:
        if "content" in d and out and "content" in out[-1]:
            out[-1] = {"content": out[-1]["content"] + d["content"]}
        else:
            out.append(d)
    return out


def call_deltas(i, name, args):
    return [{"tool_calls": [{"index": i, "id": f"call_{i}", "type": "function",
                             "function": {"name": name, "arguments": ""}}]},
            {"tool_calls": [{"index": i, "function": {"arguments": args}}]}]


EXPECTED = {
    "hermes-two": (H, HERMES_TWO,
                   [{"content": "Let me check.\n"}]
                   + call_deltas(0, "get_weather", '{"city": "Paris"}')
                   + call_deltas(1, "add", '{"a": 1}'), 2),
    "hermes-text": (H, "a < b and <tool is not a call",
                    [{"content": "a < b and <tool is not a call"}], 0),
    "hermes-malformed": (H, 'x <tool_call>{"name": 1}</tool_call> y',
                         [{"content": 'x <tool_call>{"name": 1}</tool_call> y'}], 0),
    "hermes-unterminated": (H, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}',
                            call_deltas(0, "add", '{"a": 1}'), 1),
    # each block stands alone: a call sent when its block closed stays a call when a later
    # block is malformed or cut off by the length limit (which then stays content)
    "hermes-then-cut": (H, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
                           '\n<tool_call>\n{"name":',
                        call_deltas(0, "add", '{"a": 1}') + [{"content": '<tool_call>\n{"name":'}],
                        1),
    "hermes-malformed-then-good": (H, '<tool_call>{"name": 1}</tool_call>\n<tool_call>'
                                      '{"name": "add", "arguments": {"a": 1}}</tool_call>',
                                   [{"content": '<tool_call>{"name": 1}</tool_call>\n'}]
                                   + call_deltas(0, "add", '{"a": 1}'), 1),
    "llama3": (L, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
                  '{"name": "f", "parameters": {}}',
               call_deltas(0, "add", '{"a": 1}') + call_deltas(1, "f", "{}"), 2),
    "llama3-text": (L, "  Paris is the capital.", [{"content": "  Paris is the capital."}], 0),
    # the first text decides: JSON after it is content, however the tokens split it
    "llama3-text-then-json": (L, 'Sure: {"name": "f", "parameters": {"a": 1}}',
                              [{"content": 'Sure: {"name": "f", "parameters": {"a": 1}}'}], 0),
    "llama3-malformed": (L, '{"name": "add", "parameters": {"a": 1',
                         [{"content": '{"name": "add", "parameters": {"a": 1'}], 0),
    "mistral": (M, 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]',
                [{"content": "Sure."}] + call_deltas(0, "add", '{"a": 1}'), 1),
    "mistral-text": (M, "[TOOL is not it [", [{"content": "[TOOL is not it ["}], 0),
    "mistral-malformed": (M, "[TOOL_CALLS][{oops", [{"content": "[TOOL_CALLS][{oops"}], 0),
}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_deltas_exact_for_any_chunking(case):
    fmt, text, want, n = EXPECTED[case]
    splits = [[text], list(text), [text[i:i + 3] for i in range(0, len(text), 3)],
              [text[i:i + 7] for i in range(0, len(text), 7)]]
    for chunks in splits:
        got, calls = run(fmt, chunks)
        assert merged(got) == want, (case, len(chunks))
        assert calls == n


@pytest.mark.parametrize("case", list(EXPECTED))
def test_streamed_calls_equal_the_parse(case):
    fmt, text, _, _ = EXPECTED[case]
    content, calls = parse_tool_calls(text, fmt, ids())
    got, _ = run(fmt, list(text))
    streamed_text = "".join(d["content"] for d in got if "content" in d)
    assert (streamed_text.strip() or None) == (content.strip() or None if content else None)
    streamed = [d["tool_calls"][0] for d in got if "tool_calls" in d]
    assert [(c["id"], c["function"]["name"]) for c in calls] == \
        [(d["id"], d["function"]["name"]) for d in streamed if "id" in d]
    assert [c["function"]["arguments"] for c in calls] == \
        [d["function"]["arguments"] for d in streamed if "id" not in d]


def test_content_is_not_held_longer_than_a_marker_prefix():
    s = ToolCallStream(H, ids())
    assert s.push("Hello wor") == [{"content": "Hello wor"}]
    assert s.push("ld <tool") == [{"content": "ld "}]      # "<tool" may open a call: held
    assert s.push("box>") == [{"content": "<toolbox>"}]  # it did not
    assert s.finish() == []

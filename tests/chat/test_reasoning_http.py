"""``kvserve serve --reasoning-parser think`` through the official ``openai`` client: a reply's
``<think> ... </think>`` thought comes back as the message's ``reasoning_content`` and the
answer as its ``content``, streamed (``reasoning_content`` deltas) as not; tool calls are
parsed from the answer; a prompt that leaves the model inside a thought, and a reply cut off
while thinking, are split by the same rule; without the flag the reply is as written. The
random-init model's replies are steered by a structured output (a regex or a grammar)."""
from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")

from chat_helpers import TOKEN  # noqa: E402
from kvserve_testing import running_app  # noqa: E402
from test_tools_http import MSGS, TOOLS, _streamed, _valid  # noqa: E402

THOUGHT_THEN_ANSWER = "<think>\n[a-z]{3,10}\n</think>\n\n[a-z]{2,8}"


@pytest.fixture(scope="module")
def thinking(tools_artifact):
    with running_app(tools_artifact, http_port=0, auth_token=TOKEN, max_batch=8,
                     max_queue=32, reasoning_parser="think") as app:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{app.http_port}/v1", api_key=TOKEN,
                           max_retries=0, timeout=120) as c:
            yield c


def _streamed_thought(chunks) -> tuple[str, str, str]:
    """(reasoning, content, finish_reason) of a streamed chat reply."""
    thought, content, reason = "", "", None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        thought += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        reason = ch.choices[0].finish_reason or reason
    return thought, content, reason


def _create(client, **kw):
    return client.chat.completions.create(model="artifact", **{"temperature": 0, **kw})


@pytest.mark.parametrize("logprobs", [False, True])
def test_the_thought_apart_from_the_answer(thinking, logprobs):
    kw = dict(messages=MSGS, max_tokens=64, logprobs=logprobs,
              extra_body={"structured_outputs": {"regex": THOUGHT_THEN_ANSWER}})
    c = _create(thinking, **kw).choices[0]
    m = c.message
    assert re.fullmatch("[a-z]{3,10}", m.reasoning_content), m
    assert re.fullmatch("[a-z]{2,8}", m.content), m
    chunks = list(_create(thinking, stream=True, **kw))
    assert _streamed_thought(chunks) == (m.reasoning_content, m.content, "stop")
    if logprobs:  # each token's logprobs once, whichever part its text went to
        streamed = [t.token for ch in chunks if ch.choices and ch.choices[0].logprobs
                    for t in ch.choices[0].logprobs.content]
        assert streamed == [t.token for t in c.logprobs.content] and len(streamed) > 4


def test_a_tool_call_after_the_thought(thinking, tools_artifact):
    tok = tools_artifact.tokenizer
    o, c = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    grammar = (f'start: "<think>" THOUGHT "</think>\\n\\n" <[{o}]> "\\n{{\\"name\\": '
               f'\\"get_time\\", \\"arguments\\": {{\\"zone\\": \\"" ZONE "\\"}}}}\\n" '
               f'<[{c}]>\nTHOUGHT: /[a-z]{{3,8}}/\nZONE: "UTC" | "CET"')
    kw = dict(messages=MSGS, tools=TOOLS, max_tokens=80,
              extra_body={"structured_outputs": {"grammar": grammar}})
    choice = _create(thinking, **kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert re.fullmatch("[a-z]{3,8}", choice.message.reasoning_content)
    assert not choice.message.content
    call = choice.message.tool_calls[0].function
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET")
    chunks = list(_create(thinking, stream=True, **kw))
    calls, content, reason = _streamed(chunks)
    assert reason == "tool_calls" and content == ""
    assert json.loads(calls[0]["arguments"]) == json.loads(call.arguments)
    assert _streamed_thought(chunks)[0] == choice.message.reasoning_content


OPENED = MSGS + [{"role": "assistant", "content": "<think>\n"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def test_a_prompt_that_opens_the_thought(thinking, tools_oai):
    """The template leaves the model inside ``<think>`` (here: a final assistant message
    continued): what it writes up to ``</think>`` is the thought, without an opening tag; the
    random model never closes it, so its whole greedy reply (as a server without the parser
    returns it) is the thought, the reply cut off while thinking."""
    kw = dict(messages=OPENED, max_tokens=24, extra_body=CONTINUE)
    raw = _create(tools_oai, **kw).choices[0].message.content
    assert "</think>" not in raw and not raw.lstrip().startswith("<think>")
    choice = _create(thinking, **kw).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.reasoning_content == raw.strip("\r\n") and choice.message.content is None
    assert _streamed_thought(_create(thinking, stream=True, **kw)) == \
        (raw.strip("\r\n"), "", "length")


def test_a_constrained_reply_is_the_answer(thinking):
    """Where the tokenizer has no ``<think>`` token (this model's), a forced tool call or a
    structured output is constrained from its first token: after a prompt that opened the
    thought it is still the answer (the call parsed, the JSON in ``content``), not a
    thought."""
    kw = dict(messages=OPENED, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=160, extra_body=CONTINUE)
    choice = _create(thinking, **kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.reasoning_content is None
    assert choice.message.tool_calls[0].function.name in ("get_weather", "get_time")
    calls, content, reason = _streamed(_create(thinking, stream=True, **kw))
    assert reason == "tool_calls" and calls[0]["name"] == \
        choice.message.tool_calls[0].function.name
    m = _create(thinking, messages=OPENED, max_tokens=32, extra_body={
        **CONTINUE, "structured_outputs": {"regex": "[a-z]{2,8}"}}).choices[0].message
    assert re.fullmatch("[a-z]{2,8}", m.content) and m.reasoning_content is None


def test_a_reply_cut_off_while_thinking(thinking):
    kw = dict(messages=MSGS, max_tokens=16,
              extra_body={"structured_outputs": {"regex": "<think>[a-z]{60,80}</think>x"}})
    choice = _create(thinking, **kw).choices[0]
    assert choice.finish_reason == "length"
    assert re.fullmatch("[a-z]+", choice.message.reasoning_content), choice
    assert choice.message.content is None
    thought, content, _ = _streamed_thought(_create(thinking, stream=True, **kw))
    assert (thought, content) == (choice.message.reasoning_content, "")


def test_a_reply_that_does_not_think_is_all_content(thinking):
    kw = dict(messages=MSGS, max_tokens=16,
              extra_body={"structured_outputs": {"regex": "[a-z]{2,8}"}})
    m = _create(thinking, **kw).choices[0].message
    assert re.fullmatch("[a-z]{2,8}", m.content)
    assert m.reasoning_content is None  # (there, null: as vLLM)
    assert _streamed_thought(_create(thinking, stream=True, **kw)) == ("", m.content, "stop")


def test_without_the_parser_the_reply_is_as_written(tools_oai):
    kw = dict(messages=MSGS, max_tokens=64,
              extra_body={"structured_outputs": {"regex": THOUGHT_THEN_ANSWER}})
    m = _create(tools_oai, **kw).choices[0].message
    assert re.fullmatch(THOUGHT_THEN_ANSWER, m.content), m
    assert getattr(m, "reasoning_content", None) is None


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """The tools model with ``<think>`` and ``</think>`` as added tokens (as Qwen3's are),
    served with the parser on."""
    from tools_artifact import build_tools_artifact

    art = build_tools_artifact(tmp_path_factory.mktemp("thinking_artifact"),
                               ("<think>", "</think>"))
    with running_app(art, http_port=0, auth_token=TOKEN, max_batch=8, max_queue=32,
                     reasoning_parser="think") as app:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{app.http_port}/v1", api_key=TOKEN,
                           max_retries=0, timeout=120) as c:
            yield c


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.mark.parametrize("opened", [False, True])
def test_with_think_tokens_a_constraint_applies_after_the_thought(thinker, opened):
    """Where the tokenizer has the tags as tokens, a structured output constrains the answer
    after an optional thought (required where the prompt opened it): whatever the random
    model chooses, its reply is a thought and/or a valid answer, never an invalid one; a
    thought cut off leaves content null; streamed as not."""
    msgs = OPENED if opened else MSGS
    extra = {**(CONTINUE if opened else {}),
             "response_format": {"type": "json_schema",
                                 "json_schema": {"name": "a", "schema": SCHEMA}}}
    seen = set()
    for seed in range(8):
        kw = dict(messages=msgs, max_tokens=48, temperature=1.0, seed=seed, extra_body=extra)
        choice = _create(thinker, **kw).choices[0]
        m = choice.message
        if opened:
            assert m.reasoning_content is not None
        if choice.finish_reason == "stop":  # (else cut off, in the thought or the answer)
            assert json.loads(m.content).keys() == {"a"}, m
            seen.add("thought, answer" if m.reasoning_content is not None else "answer")
        elif m.content is None:
            assert m.reasoning_content is not None
            seen.add("cut off thinking")
        thought, content, _ = _streamed_thought(_create(thinker, stream=True, **kw))
        assert (thought, content) == (m.reasoning_content or "", m.content or "")
    # (the random model answers at once or opens a thought it does not close in 48 tokens;
    # a thought closed and then answered: tests/structured/test_constraints.py)
    assert seen == ({"cut off thinking"} if opened else {"answer", "cut off thinking"}), seen


def test_with_think_tokens_a_forced_call_comes_after_the_thought(thinker):
    """A forced tool call on the think-token model: the reply is a thought and/or the call,
    parsed from the answer; a constraint with no first token is still refused (400)."""
    kw = dict(messages=MSGS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=160)
    kinds = set()
    for seed in range(4):
        choice = _create(thinker, temperature=1.0, seed=seed, **kw).choices[0]
        if choice.finish_reason == "tool_calls":
            _valid(choice.message.tool_calls[0])
            kinds.add("call")
        else:  # cut off: thinking, or in the call after the thought
            m = choice.message
            assert choice.finish_reason == "length" and m.reasoning_content is not None
            assert m.content is None or m.content.startswith("<tool_call>\n{"), m
            kinds.add("cut off thinking" if m.content is None else "cut off in the call")
    assert "cut off in the call" in kinds or "call" in kinds, kinds  # (an answer after one)
    with pytest.raises(openai.BadRequestError, match="no first token"):
        _create(thinker, messages=MSGS, max_tokens=8, extra_body={
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "r", "schema": {"$ref": "#"}}}})

"""Structured outputs over the OpenAI-compatible HTTP API, through the official ``openai``
client, on a random-init model (its output is valid only because the server enforces the
constraint): ``response_format`` json_schema (greedy and sampled, streamed and not, n > 1 each
with its own matcher) and json_object on chat and completions, vLLM's ``structured_outputs``
and ``guided_*`` fields, and bad constraints answered 400 naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

openai = pytest.importorskip("openai")

# bounded fields: a random model's free integer or string would run to max_tokens
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 150},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "Describe a person as JSON."}]
SAMPLINGS = {"greedy": dict(temperature=0), "sampled": dict(temperature=0.9, seed=11),
             "hot": dict(temperature=1.3, top_p=0.95, seed=3)}


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_json_schema_replies_validate(tools_oai, sampling):
    r = tools_oai.chat.completions.create(model="artifact", messages=MSGS, response_format=RF,
                                          max_tokens=96, **sampling)
    c = r.choices[0]
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert c.finish_reason == "stop"
    # the same streamed
    chunks = list(tools_oai.chat.completions.create(model="artifact", messages=MSGS,
                                                    response_format=RF, max_tokens=96,
                                                    stream=True, **sampling))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    if sampling.get("temperature") == 0 or "seed" in sampling:
        assert text == c.message.content  # streamed or not, the same reply


def test_every_choice_has_its_own_matcher(tools_oai):
    r = tools_oai.chat.completions.create(model="artifact", messages=MSGS, response_format=RF,
                                          max_tokens=96, n=4, temperature=1.2, seed=5)
    texts = [c.message.content for c in r.choices]
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    assert len(set(texts)) > 1  # sampled apart, each matcher fed its own tokens


def test_completions_json_schema_and_json_object(tools_oai):
    r = tools_oai.completions.create(model="artifact", prompt="JSON:", max_tokens=96,
                                     extra_body={"response_format": RF})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    for stream in (False, True):
        kw = dict(model="artifact", messages=MSGS, max_tokens=64, temperature=0.8, seed=2,
                  response_format={"type": "json_object"})
        if stream:
            chunks = list(tools_oai.chat.completions.create(stream=True, **kw))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        else:
            c = tools_oai.chat.completions.create(**kw).choices[0]
            text, reason = c.message.content, c.finish_reason
        if reason == "length":  # an unbounded object may outrun max_tokens
            assert text.startswith("{")
        else:
            assert isinstance(json.loads(text), dict)


def test_regex_choice_and_grammar_hold(tools_oai):
    pat = r"[a-c]{2,5}-[0-9]{3}"
    for extra in ({"structured_outputs": {"regex": pat}}, {"guided_regex": pat}):
        r = tools_oai.chat.completions.create(model="artifact", messages=MSGS, max_tokens=32,
                                              temperature=1.0, seed=1, extra_body=extra)
        assert re.fullmatch(pat, r.choices[0].message.content)
    choices = ["red", "green", "blue sky"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = tools_oai.completions.create(model="artifact", prompt="Color:", max_tokens=16, n=3,
                                         temperature=1.0, seed=4, extra_body=extra)
        assert all(c.text in choices for c in r.choices)
    grammar = 'start: "(" NUM ("," NUM)? ")"\nNUM: /[0-9]{1,3}/'
    r = tools_oai.completions.create(model="artifact", prompt="Tuple:", max_tokens=16,
                                     extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})?\)", r.choices[0].text)


@pytest.mark.parametrize("extra, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema", "frob"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                "schema": "{not json"}}},
     "response_format.json_schema.schema", "not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "missing"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex", "unclosed"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"guided_json": {"type": "string", "pattern": "(?=a)b"}}, "guided_json", "look-around"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format",
     "send one"),
    # compiles, but its matcher allows no first token (found when the matcher is made)
    ({"guided_json": {"$ref": "#"}}, "guided_json", "allows no first token"),
    ({"structured_outputs": {"regex": "[a&&b]"}}, "structured_outputs.regex",
     "allows no first token"),
])
def test_bad_constraints_are_400_naming_the_field(tools_oai, extra, param, fragment):
    with pytest.raises(openai.BadRequestError) as e:
        tools_oai.chat.completions.create(model="artifact", messages=MSGS, max_tokens=8,
                                          extra_body=extra)
    err = e.value.body
    assert err["param"] == param, err
    assert param in err["message"] and fragment in err["message"], err


def test_a_dead_end_schema_is_a_400_not_a_reply(tools_oai, tools_app):
    """A schema whose required property leads only back to itself: 400 (constraint_stuck),
    not '{"a":' finished with "stop"; streamed, the stream's last event is that error; both
    counted under that outcome."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}},
              "required": ["a"], "$defs": {"n": {"$ref": "#/$defs/n"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    counted = lambda: tools_app.metrics.requests.get(  # noqa: E731
        rpc="http /v1/chat/completions", outcome="constraint_stuck")
    before = counted()
    with pytest.raises(openai.BadRequestError) as e:
        tools_oai.chat.completions.create(model="artifact", messages=MSGS, max_tokens=16,
                                          response_format=rf)
    err = e.value.body
    assert err["code"] == "constraint_stuck" and "allows no next token" in err["message"], err
    with pytest.raises(openai.APIError, match="allows no next token"):
        for _ in tools_oai.chat.completions.create(model="artifact", messages=MSGS,
                                                   max_tokens=16, response_format=rf,
                                                   stream=True):
            pass
    assert counted() == before + 2

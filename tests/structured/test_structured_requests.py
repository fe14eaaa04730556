"""server/structured_requests.py: every way a request asks for structured output maps to the
right ConstraintSpec; bad or conflicting fields are refused naming the field."""
from __future__ import annotations

import pytest

from kvserve.server.constraints import ConstraintSpec
from kvserve.server.domain import InvalidArgument
from kvserve.server.structured_requests import constraint_from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("body, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ConstraintSpec.json_object()),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}, ConstraintSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, ConstraintSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": '{"type": "integer"}'}},
     ConstraintSpec.json_schema('{"type": "integer"}')),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
     ConstraintSpec.regex("[a-z]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, ConstraintSpec.choice(["a", "b"])),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, ConstraintSpec.lark('start: "x"')),
    ({"structured_outputs": {"json_object": True}}, ConstraintSpec.json_object()),
    ({"guided_json": SCHEMA}, ConstraintSpec.json_schema(SCHEMA)),
    ({"guided_regex": "[0-9]"}, ConstraintSpec.regex("[0-9]")),
    ({"guided_choice": ["y", "n"]}, ConstraintSpec.choice(["y", "n"])),
    ({"guided_grammar": 'start: "x"'}, ConstraintSpec.lark('start: "x"')),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, ConstraintSpec.regex("a")),
])
def test_mapping(body, want):
    got = constraint_from_request(body)
    if want is None:
        assert got is None
    else:
        assert (got.kind, got.grammar) == (want.kind, want.grammar)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object"),
    ({"guided_regex": "a"}, "guided_regex"),
])
def test_field_names_for_later_errors(body, field):
    assert constraint_from_request(body).field == field


@pytest.mark.parametrize("body, message", [
    ({"response_format": "json"}, "response_format must be an object with a 'type'"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "takes no other fields"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema is missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "x": 1}}},
     "unsupported fields: x"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA,
                                                                 "strict": "yes"}}},
     "strict must be true or false"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
     r"^response_format\.json_schema\.schema: Invalid type: frob"),
    ({"structured_outputs": {"regex": "a("}}, r"^structured_outputs\.regex: .*unclosed group"),
    ({"structured_outputs": {"choice": []}}, r"^structured_outputs\.choice has 0 choices"),
    ({"structured_outputs": {}}, "exactly one of json, regex, choice, grammar, json_object"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, r"exactly one .*\(got 2\)"),
    ({"structured_outputs": {"structural_tag": {}}}, "structural_tag is not supported"),
    ({"structured_outputs": {"regexp": "a"}}, "unrecognized fields: regexp"),
    ({"structured_outputs": "json"}, "structured_outputs must be an object"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "'response_format' and 'structured_outputs' both constrain the output"),
    ({"guided_json": 3}, "^guided_json must be a JSON schema"),
])
def test_refused(body, message):
    with pytest.raises(InvalidArgument, match=message):
        constraint_from_request(body)

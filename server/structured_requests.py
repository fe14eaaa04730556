"""The request fields that ask for structured output -> one ``ConstraintSpec`` (or None):
OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older top-level
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. Pure: plain
JSON values in; bad values raise ``InvalidArgument`` naming the field."""
from __future__ import annotations

from typing import Any

from .constraints import ConstraintSpec
from .domain import InvalidArgument

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar")
SO_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# vLLM's structured_outputs options that change nothing here (llguidance's JSON is already
# whitespace-flexible and follows the schema's additionalProperties)
SO_IGNORED = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties"}
SO_REFUSED = {"structural_tag", "whitespace_pattern", "backend"}


def constraint_from_request(body: dict) -> ConstraintSpec | None:
    """The request's constraint, None when it asks for none. Two ways of asking at once (e.g.
    ``response_format`` json_schema and ``structured_outputs``) are refused."""
    found = [(k, body[k]) for k in FIELDS if body.get(k) is not None
             and not (k == "response_format" and _is_text(body[k]))]
    if not found:
        return None
    if len(found) > 1:
        raise InvalidArgument(f"'{found[0][0]}' and '{found[1][0]}' both constrain the "
                              "output: send one")
    key, value = found[0]
    if key == "response_format":
        return _response_format(value)
    if key == "structured_outputs":
        return _structured_outputs(value)
    kind = SO_KINDS[key[len("guided_"):]]
    return _spec(kind, value, key)


def _is_text(rf: Any) -> bool:
    return isinstance(rf, dict) and rf.get("type") == "text" and set(rf) <= {"type"}


def _spec(kind: str, value: Any, field: str) -> ConstraintSpec:
    if kind == "json_schema":
        return ConstraintSpec.json_schema(value, field=field)
    if kind == "choice":
        if isinstance(value, list):
            value = tuple(value)
        return ConstraintSpec("choice", value, field)
    return ConstraintSpec(kind, value, field)


def _response_format(rf: Any) -> ConstraintSpec:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidArgument("response_format must be an object with a 'type'")
    t = rf["type"]
    if t == "json_object":
        if set(rf) - {"type"}:
            raise InvalidArgument("response_format: json_object takes no other fields")
        return ConstraintSpec.json_object(field="response_format")
    if t != "json_schema":
        raise InvalidArgument(f"response_format.type must be \"text\", \"json_object\" or "
                              f"\"json_schema\", not {t[:40]!r}")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise InvalidArgument("response_format.json_schema must be an object with 'name' and "
                              "'schema'")
    extra = sorted(set(js) - {"name", "schema", "strict", "description"})
    if extra:
        raise InvalidArgument(f"response_format.json_schema has unsupported fields: "
                              f"{', '.join(extra[:5])}")
    if "name" in js and not isinstance(js["name"], str):
        raise InvalidArgument("response_format.json_schema.name must be a string")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise InvalidArgument("response_format.json_schema.strict must be true or false")
    if "schema" not in js:
        raise InvalidArgument("response_format.json_schema.schema is missing")
    return ConstraintSpec.json_schema(js["schema"], field="response_format.json_schema.schema")


def _structured_outputs(so: Any) -> ConstraintSpec:
    if not isinstance(so, dict):
        raise InvalidArgument("structured_outputs must be an object (json, regex, choice or "
                              "grammar)")
    refused = sorted(set(so) & SO_REFUSED)
    if refused:
        raise InvalidArgument(f"structured_outputs.{refused[0]} is not supported")
    unknown = sorted(set(so) - set(SO_KINDS) - SO_IGNORED - {"json_object"})
    if unknown:
        raise InvalidArgument(f"structured_outputs has unrecognized fields: "
                              f"{', '.join(unknown[:5])}")
    kinds = [k for k in SO_KINDS if so.get(k) is not None]
    if so.get("json_object"):
        kinds.append("json_object")
    if len(kinds) != 1:
        raise InvalidArgument("structured_outputs needs exactly one of json, regex, choice, "
                              f"grammar, json_object (got {len(kinds)})")
    k = kinds[0]
    if k == "json_object":
        return ConstraintSpec.json_object(field="structured_outputs.json_object")
    return _spec(SO_KINDS[k], so[k], f"structured_outputs.{k}")

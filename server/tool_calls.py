"""Tool calls (pure functions): checking ``tools`` / ``tool_choice``, the constraint that makes
``required`` or a named function produce a valid call, the family's output format read from its
chat template, and the parser of a finished output into OpenAI ``tool_calls``.

Formats (what the families' chat templates tell the model to write):

- ``hermes`` (Qwen2.5/Qwen3, Hermes, many fine-tunes):
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` (one block per call);
- ``llama3_json`` (Llama 3.1-3.3): the bare ``{"name": "f", "parameters": {...}}``, optionally
  after ``<|python_tag|>``; several calls separated by ``; `` (vLLM's llama3_json parser);
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (and the v11 form
  ``[TOOL_CALLS]f[ARGS]{...}``).

The parsers need the generated text with special tokens kept (Mistral's ``[TOOL_CALLS]`` and
Llama's ``<|python_tag|>`` are control tokens).
"""
from __future__ import annotations

import enum
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .constraints import JSON_DEFAULTS, ConstraintSpec
from .domain import InvalidArgument

MAX_TOOLS = 128
MAX_NAME_CHARS = 64
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names
_ALNUM = string.ascii_letters + string.digits


class ToolFormat(str, enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


def detect_format(template_source: str | None) -> ToolFormat | None:
    """The tool-call format a chat template asks for, None if it has none (tools refused)."""
    src = template_source or ""
    if "[TOOL_CALLS]" in src:
        return ToolFormat.MISTRAL
    if "<tool_call>" in src:
        return ToolFormat.HERMES
    if ("<|python_tag|>" in src or '"parameters": dictionary of argument name' in src
            or "Environment: ipython" in src):
        return ToolFormat.LLAMA3_JSON
    return None


def new_call_id() -> str:
    """``call_`` + 24 random letters/digits (OpenAI's shape)."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict
    raw: dict  # the request's tool, as the chat template receives it


def check_tools(tools: Any, field: str = "tools") -> list[Tool]:
    """OpenAI ``tools`` ([{"type": "function", "function": {"name", "description",
    "parameters"}}]) checked; errors name the field."""
    if not isinstance(tools, list) or not tools:
        raise InvalidArgument(f"{field} must be a non-empty list of tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"{field} has {len(tools)} tools; the limit is {MAX_TOOLS}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        f = f"{field}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise InvalidArgument(f'{f}.type must be "function" (the only tool type served)')
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise InvalidArgument(f"{f}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidArgument(f"{f}.function.name must be 1 to {MAX_NAME_CHARS} letters, "
                                  "digits, '_', '.' or '-'")
        if name in seen:
            raise InvalidArgument(f"{f}.function.name {name!r} is given twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidArgument(f"{f}.function.parameters must be a JSON schema (an object)")
        out.append(Tool(name, params, t))
    return out


def check_tool_choice(choice: Any, tools: Sequence[Tool], field: str = "tool_choice"
                      ) -> str | Tool:
    """``none`` / ``auto`` / ``required`` (returned as is) or the named function's Tool."""
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        for t in tools:
            if t.name == name:
                return t
        raise InvalidArgument(f"{field}.function.name {str(name)[:64]!r} is not one of the "
                              "tools")
    raise InvalidArgument(f'{field} must be "none", "auto", "required" or {{"type": '
                          '"function", "function": {"name": ...}}')


def _call_schema(tool: Tool, args_key: str) -> dict:
    return {"type": "object",
            "properties": {"name": {"const": tool.name}, args_key: tool.parameters},
            "required": ["name", args_key], "additionalProperties": False}


def added_token_ids(tokenizer_json: str) -> dict[str, int]:
    """The tokenizer's added tokens (content -> id), e.g. Qwen's ``<tool_call>``, Mistral's
    ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``: llguidance knows these as tokens, never as
    text, so a grammar must ask for the token."""
    try:
        added = json.loads(tokenizer_json).get("added_tokens") or []
    except ValueError:
        return {}
    return {t["content"]: int(t["id"]) for t in added
            if isinstance(t, dict) and isinstance(t.get("content"), str) and "id" in t}


def tool_constraint(tools: Sequence[Tool], choice: str | Tool, fmt: ToolFormat,
                    parallel_tool_calls: bool = True, added_tokens: dict[str, int] | None = None
                    ) -> ConstraintSpec | None:
    """What constrains generation: None for ``auto``/``none``; for ``required`` one call (or,
    with ``parallel_tool_calls``, one or more) of any tool, for a named function that function
    only, in ``fmt`` with arguments valid under the tool's ``parameters`` schema.
    ``added_tokens`` (``added_token_ids(tokenizer_json)``): the format's markers that are
    added tokens (``<tool_call>``, ``</tool_call>``, ``[TOOL_CALLS]``) are asked for as those
    tokens, the others as text."""
    if choice in ("none", "auto"):
        return None
    chosen = [choice] if isinstance(choice, Tool) else list(tools)
    many = parallel_tool_calls and not isinstance(choice, Tool)
    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    schemas = [_call_schema(t, key) for t in chosen]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # as every JSON constraint: no free whitespace (a weak model fills the reply with newlines)
    one = {**one, "x-guidance": dict(JSON_DEFAULTS)}
    js = "%json " + json.dumps(one, ensure_ascii=False)
    added = added_tokens or {}
    lit = lambda s: json.dumps(s)  # noqa: E731 - a Lark string literal
    mark = lambda s: f"<[{int(added[s])}]>" if s in added else lit(s)  # noqa: E731
    nl = lit("\n")
    if fmt is ToolFormat.HERMES:
        call = f"{mark('<tool_call>')} {nl} {js} {nl} {mark('</tool_call>')}"
        rule = f"call: {call}\nstart: call" + (f" ({nl} call)*" if many else "")
    elif fmt is ToolFormat.LLAMA3_JSON:
        rule = f"call: {js}\nstart: call" + (f" ({lit('; ')} call)*" if many else "")
    else:
        rule = (f"call: {js}\nstart: {mark('[TOOL_CALLS]')} {lit('[')} call"
                + (f" ({lit(', ')} call)*" if many else "") + f" {lit(']')}")
    return ConstraintSpec.lark(rule, field="tool_choice")


# --- parsing a finished output -------------------------------------------------------------
# what json raises on a model's text that is no JSON, or nests past Python's stack ([[[[...)
NOT_JSON = (ValueError, RecursionError)


def _call(obj: Any, new_id: Callable[[], str]) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except NOT_JSON:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": new_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _hermes(text: str, new_id) -> tuple[str | None, list[dict]] | None:
    """Each ``<tool_call>`` block on its own: a valid one is a call, a malformed one, or one
    cut off (no ``</tool_call>``: the length limit), stays in the content as written, so that
    the calls a stream sent as their blocks closed are these (``tool_call_stream``)."""
    if "<tool_call>" not in text:
        return None
    calls, rest, pos = [], [], 0
    for m in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S):
        rest.append(text[pos:m.start()])
        pos = m.end()
        try:
            c = _call(json.loads(m.group(1).strip()), new_id)
        except NOT_JSON:
            c = None
        if c is None:
            rest.append(m.group(0))
        else:
            calls.append(c)
    rest.append(text[pos:])
    if not calls:
        return None
    content = "".join(rest).strip()
    return content or None, calls


def _json_seq(s: str, sep: str) -> list | None:
    """Objects written one after another, separated by ``sep`` (and whitespace)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(s) and s[i].isspace():
            i += 1
        try:
            obj, i = dec.raw_decode(s, i)
        except NOT_JSON:
            return None
        out.append(obj)
        j = i
        while j < len(s) and s[j].isspace():
            j += 1
        if j == len(s):
            return out
        if not s.startswith(sep, j):
            return None
        i = j + len(sep)


def _llama3(text: str, new_id) -> tuple[str | None, list[dict]] | None:
    s = text.strip()
    if s.startswith("<|python_tag|>"):
        s = s[len("<|python_tag|>"):].lstrip()
    if not s.startswith("{"):
        return None
    objs = _json_seq(s, ";")
    calls = [_call(o, new_id) for o in objs or []]
    if not calls or any(c is None for c in calls):
        return None
    return None, calls


def _mistral(text: str, new_id) -> tuple[str | None, list[dict]] | None:
    k = text.find("[TOOL_CALLS]")
    if k < 0:
        return None
    content, body = text[:k].strip() or None, text[k + len("[TOOL_CALLS]"):].strip()
    if body.startswith("[") or body.startswith("{"):
        objs = _json_seq(body, ",")
        if objs and len(objs) == 1 and isinstance(objs[0], list):
            objs = objs[0]
    else:  # v11: name[ARGS]{...} repeated
        objs = []
        for part in body.split("[TOOL_CALLS]"):
            name, sep, args = part.partition("[ARGS]")
            try:
                objs.append({"name": name.strip(), "arguments": json.loads(args)} if sep
                            else None)
            except NOT_JSON:
                return None
    calls = [_call(o, new_id) for o in objs or []]
    if not calls or any(c is None for c in calls):
        return None
    return content, calls


_PARSERS = {ToolFormat.HERMES: _hermes, ToolFormat.LLAMA3_JSON: _llama3,
            ToolFormat.MISTRAL: _mistral}


def parse_tool_calls(text: str, fmt: ToolFormat, new_id: Callable[[], str] = new_call_id
                     ) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished output. A malformed call (bad JSON, no name,
    arguments not an object) leaves the whole text as content and no calls, as vLLM does,
    except in Hermes' blocks, each of which stands alone (``_hermes``); with calls,
    ``finish_reason`` is ``"tool_calls"`` (``finish_reason``)."""
    got = _PARSERS[fmt](text, new_id)
    if got is None:
        return text, []
    return got


def finish_reason(reason: str, calls: bool) -> str:
    """A chat choice's ``finish_reason``: ``"tool_calls"`` when it made calls and the model
    ended its turn; a turn cut off (``"length"``) says so, whatever calls came before."""
    return "tool_calls" if calls and reason == "stop" else reason

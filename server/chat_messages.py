"""Chat messages beyond (role, content): OpenAI's assistant ``tool_calls``, ``tool`` results
(``tool_call_id``, ``name``), and the extra variables a template takes
(``chat_template_kwargs``), checked and shaped as transformers' ``apply_chat_template``
receives them from vLLM (a call's ``arguments`` JSON string becomes an object: Llama 3's and
Qwen's templates write ``arguments | tojson``)."""
from __future__ import annotations

import json
from typing import Any

from .domain import InvalidArgument

MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content"}
RESERVED_KWARGS = {"messages", "tools", "documents", "add_generation_prompt"}
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_CHARS = 16 * 1024
MAX_TOOL_CALLS = 64


def message_dict(i: int, m: dict) -> tuple[dict, int]:
    """(the message as the template gets it, its size in characters for the chat's limit)."""
    f = f"messages[{i}]"
    extra = sorted(set(m) - MESSAGE_KEYS)
    if extra:
        raise InvalidArgument(f"{f} has unsupported fields: {', '.join(extra[:5])}")
    out: dict[str, Any] = {"role": m.get("role"), "content": m.get("content")}
    if out["content"] is None and not m.get("tool_calls"):
        raise InvalidArgument(f"{f}.content must be a string")
    if out["content"] is not None and not isinstance(out["content"], str):
        raise InvalidArgument(f"{f}.content must be a string")
    size = len(out["content"] or "")
    for k in ("tool_call_id", "name", "reasoning_content"):
        if m.get(k) is not None:
            if not isinstance(m[k], str):
                raise InvalidArgument(f"{f}.{k} must be a string")
            out[k] = m[k]
            size += len(m[k])
    if m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not 1 <= len(calls) <= MAX_TOOL_CALLS:
            raise InvalidArgument(f"{f}.tool_calls must be a list of 1 to {MAX_TOOL_CALLS} "
                                  "calls")
        out["tool_calls"] = [_tool_call(f"{f}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
        size += len(json.dumps(out["tool_calls"], ensure_ascii=False))
    if out["content"] is None:
        # a call's null content: "" (templates test or trim it; transformers' own None would
        # reach the template as none, which Qwen's and Llama's templates treat as "")
        out["content"] = ""
    return out, size


def _tool_call(f: str, c: Any) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidArgument(f"{f} must be {{\"type\": \"function\", \"function\": "
                              "{\"name\", \"arguments\"}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            raise InvalidArgument(f"{f}.function.arguments is not valid JSON (or nests too "
                                  "deeply)") from None
    if not isinstance(args, dict):
        raise InvalidArgument(f"{f}.function.arguments must be a JSON object")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(c.get("id"), str):
        out["id"] = c["id"]
    return out


def template_kwargs(kw: Any, field: str = "chat_template_kwargs") -> dict:
    """Extra template variables (e.g. Qwen3's ``enable_thinking``): plain JSON values under
    identifier names, bounded; the names the renderer sets itself are refused."""
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise InvalidArgument(f"{field} must be an object")
    if len(kw) > MAX_TEMPLATE_KWARGS:
        raise InvalidArgument(f"{field} has {len(kw)} entries; the limit is "
                              f"{MAX_TEMPLATE_KWARGS}")
    for k in kw:
        if not isinstance(k, str) or not k.isidentifier():
            raise InvalidArgument(f"{field}: {str(k)[:40]!r} is not a template variable name")
        if k in RESERVED_KWARGS:
            raise InvalidArgument(f"{field}.{k} is set by the server (use the request's own "
                                  "field)")
    if len(json.dumps(kw, ensure_ascii=False)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidArgument(f"{field} is over {MAX_TEMPLATE_KWARGS_CHARS} characters")
    return dict(kw)

"""``/v1/chat/completions`` request bodies -> ``Parsed``: the messages (with assistant
``tool_calls`` and ``tool`` results) rendered with the chat template, the template's own
options (``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``),
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and the structured-output fields. No HTTP
library here; errors are ``ApiError``s whose ``param`` names the field."""
from __future__ import annotations

from typing import Any

from . import tool_calls as TC
from .domain import FailedPrecondition, InvalidArgument
from .openai_requests import (CHAT_FIELDS, Parsed, _bool, _common, _int, _max_tokens,
                              _requests, bad, chat_messages, check_prompt_scores, error_param,
                              prompt_logprobs, structured_spec)
from .prompts import Prompts

_TEMPLATE_FIELDS = ("chat_template_kwargs", "continue_final_message", "add_generation_prompt")
NO_TOOL_FORMAT = ("this model's chat template has no tool-call format (a template that writes "
                  "Hermes/Qwen <tool_call>, Llama 3 JSON or Mistral [TOOL_CALLS] calls): "
                  "'tools' cannot be served")


def _tools(body: dict, template_source: str | None):
    """(tools, tool_choice, format): tools [] when none are given; format None when the
    output is not parsed for calls (no tools, or tool_choice "none")."""
    raw = body.get("tools")
    try:
        tools = TC.check_tools(raw) if raw not in (None, []) else []
        choice = TC.check_tool_choice(body.get("tool_choice"), tools)
    except InvalidArgument as e:
        raise bad(str(e), error_param(str(e), body, ("tools", "tool_choice"))) from None
    if not tools:
        if choice not in ("none", "auto"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return [], "none", None
    if choice == "none":
        return tools, choice, None
    fmt = TC.detect_format(template_source)
    if fmt is None:
        raise bad(NO_TOOL_FORMAT, "tools")
    return tools, choice, fmt


def _template_flags(body: dict) -> tuple[bool, bool]:
    cont = _bool(body, "continue_final_message", False)
    agp = _bool(body, "add_generation_prompt", not cont)
    if agp and cont:
        raise bad("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                  "continue_final_message")
    return agp, cont


def _prediction(body: dict, prompts: Prompts) -> tuple[int, ...]:
    """OpenAI's ``prediction`` (``{"type": "content", "content": text or text parts}``): its
    tokens, in which the n-gram drafts of speculative decoding are looked up too (the output
    is the same with or without it; it only saves steps where the reply repeats it)."""
    p = body.get("prediction")
    if p is None:
        return ()
    shape = ("'prediction' must be {\"type\": \"content\", \"content\": a string or text "
             "parts}")
    if not isinstance(p, dict) or p.get("type") != "content" or set(p) - {"type", "content"}:
        raise bad(shape, "prediction")
    content = p.get("content")
    if isinstance(content, list):
        if not all(isinstance(x, dict) and x.get("type") == "text" and set(x) <= {"type", "text"}
                   and isinstance(x.get("text"), str) for x in content):
            raise bad(shape, "prediction")
        content = "".join(x["text"] for x in content)
    if not isinstance(content, str):
        raise bad(shape, "prediction")
    try:
        return prompts.prediction(content, None, "prediction.content")
    except InvalidArgument as e:
        raise bad(str(e), "prediction") from None


def parse_chat(body: dict, prompts: Prompts, model: str, rid: str,
               added_tokens: dict[str, int] | None = None) -> Parsed:
    """``added_tokens``: the tokenizer's added tokens (``tool_calls.added_token_ids``), for
    the constraint of ``tool_choice`` "required" or a named function."""
    lim = prompts.lim
    opts = _common(body, CHAT_FIELDS, model, lim)
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, 0, lim.cfg.max_top_logprobs)
    if top and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    p_lp = prompt_logprobs(body, lim)
    messages = chat_messages(body.get("messages"), lim)
    template = prompts.template
    tools, choice, fmt = _tools(body, template.source if template is not None else None)
    parallel = _bool(body, "parallel_tool_calls", True)
    spec = structured_spec(body)
    if fmt is not None and choice != "auto":
        if spec is not None:
            raise bad(f"'tool_choice' {choice if isinstance(choice, str) else 'function'} and "
                      "a structured output both constrain the reply: send one", "tool_choice")
        try:
            spec = TC.tool_constraint(tools, choice, fmt, parallel, added_tokens)
        except InvalidArgument as e:  # a tool's parameters schema llguidance refuses
            raise bad(f"tools: {e}", "tools") from None
    agp, cont = _template_flags(body)
    try:
        ids = prompts.chat(messages, add_generation_prompt=agp, continue_final_message=cont,
                           tools=[t.raw for t in tools] or None,
                           template_kwargs=body.get("chat_template_kwargs"))
    except FailedPrecondition:
        raise
    except InvalidArgument as e:
        raise bad(str(e), error_param(str(e), body, _TEMPLATE_FIELDS, "messages")) from None
    max_tokens = _max_tokens(body, ("max_tokens", "max_completion_tokens"), None, lim)
    reqs = _requests([ids], opts, max_tokens, logprobs, top, rid, lim,
                     _prediction(body, prompts))
    if p_lp is not None:
        check_prompt_scores([ids], lim)
    return Parsed(model, opts["stream"], opts["include_usage"], opts["n"], reqs, logprobs, top,
                  spec=spec, tool_format=fmt, prompt_logprobs=p_lp, prompt_ids=[ids])


def tool_call_message(text: str, fmt: Any) -> tuple[dict, bool]:
    """A finished reply as OpenAI's assistant message: (message, has calls)."""
    if fmt is None:
        return {"role": "assistant", "content": text}, False
    content, calls = TC.parse_tool_calls(text, fmt)
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": content, "tool_calls": calls}, True

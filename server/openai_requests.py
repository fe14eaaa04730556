"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) -> domain
``GenerateRequest``s, every field type-checked and bounded. Errors are ``ApiError``s that carry
OpenAI's error shape (HTTP status, message, type, param, code). No HTTP library here."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from . import request_map as RM
from . import validation as V
from .constraints import ConstraintSpec
from .domain import (FailedPrecondition, GenerateRequest, InvalidArgument, OutputParams,
                     ServingError, Unimplemented)
from .chat_messages import MESSAGE_KEYS
from .prompts import Prompts
from .structured_requests import FIELDS as STRUCTURED_FIELDS
from .structured_requests import constraint_from_request

# the sampling fields come from the one request mapping (request_map.SAMPLING_FIELDS)
_COMMON = {"model", "max_tokens", "n", "stream", "stream_options", "stop", "user",
           "logit_bias", "ignore_eos", "prompt_cache_key",
           "prompt_cache_retention"} | RM.FIELD_NAMES
_COMMON |= set(STRUCTURED_FIELDS) | {"prompt_logprobs"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                         "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                         "add_generation_prompt", "continue_final_message", "prediction"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_MAX_HINT_CHARS = 1024  # user, prompt_cache_key, prompt_cache_retention (OpenAI's: 64 for user)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def check_json_body(headers) -> None:
    """A request body is JSON unless its ``Content-Type`` says otherwise (curl and some
    clients send none)."""
    ctype = headers.get("Content-Type")
    if ctype is not None and ctype.split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "send the request body as application/json",
                       code="unsupported_media_type")


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def from_serving_error(e: ServingError) -> ApiError:
    """Domain errors -> OpenAI shapes (the same message the gRPC caller gets)."""
    from .domain import QueueFull, Unavailable
    if isinstance(e, QueueFull):
        return ApiError(429, str(e), "rate_limit_error", code="rate_limit_exceeded")
    if isinstance(e, Unavailable):
        return ApiError(503, str(e), "service_unavailable", code="service_unavailable")
    if isinstance(e, FailedPrecondition):
        return ApiError(400, str(e), param=e.field, code="failed_precondition")
    if isinstance(e, Unimplemented):
        return ApiError(400, str(e), param=e.field, code="unsupported")
    return ApiError(400, str(e), param=e.field)


def parse_json(raw: bytes) -> dict:
    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=no_constants)
    except UnicodeDecodeError:
        raise bad("the request body is not UTF-8") from None
    except RecursionError:
        raise bad("the request body nests too deeply") from None
    except ValueError as e:
        raise bad(f"the request body is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


# --- typed getters ---------------------------------------------------------------------------
def _int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer in [{lo}, {hi}]", name)
    if not lo <= v <= hi:
        raise bad(f"'{name}' is {v}; it must be in [{lo}, {hi}]", name)
    return v


def _num(body: dict, name: str, default: float, lo: float, hi: float,
         lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"'{name}' must be a number in {rng}", name)
    if not ((lo < v) if lo_open else (lo <= v)) or v > hi:
        raise bad(f"'{name}' is {v:g}; it must be in {rng}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false", name)
    return v


def _stop(body: dict, lim: V.Limits) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    c = lim.cfg
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop' must be a string or an array of strings", "stop")
    if len(v) > c.max_stop_strings:
        raise bad(f"'stop' has {len(v)} strings; the limit is {c.max_stop_strings}", "stop")
    if any(not 0 < len(s) <= c.max_stop_string_chars for s in v):
        raise bad(f"each 'stop' string must have 1 to {c.max_stop_string_chars} characters",
                  "stop")
    return v


@dataclass
class Parsed:
    """A validated request: ``requests[p * n + j]`` is choice j of prompt p."""
    model: str
    stream: bool
    include_usage: bool
    n: int
    requests: list[GenerateRequest] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    # what constrains every choice (each gets its own matcher); None: nothing
    spec: ConstraintSpec | None = None
    # chat with tools: the format the output is parsed in (tool_calls); None: no parsing
    tool_format: Any = None
    # completions: ``echo`` (the prompt's text and, with logprobs, its tokens' logprobs first)
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's extension: top-n per prompt token
    prompt_ids: list[list[int]] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)
    generate: bool = True  # False: max_tokens 0 with echo (the prompt's scores only)
    # chat with --reasoning-parser think: whether the prompt leaves the model inside a
    # thought (``server.reasoning``); None: replies are not split
    reasoning_open: bool | None = None

    @property
    def scores_prompt(self) -> bool:
        """The prompts' own logprobs are asked for (the engine's Score path)."""
        return (self.echo and self.logprobs) or self.prompt_logprobs is not None


def structured_spec(body: dict) -> ConstraintSpec | None:
    """``response_format`` / ``structured_outputs`` / ``guided_*`` -> the constraint; a bad one
    is a 400 whose ``param`` names the field (e.g. ``response_format.json_schema.schema``)."""
    try:
        return constraint_from_request(body)
    except InvalidArgument as e:
        raise bad(str(e), e.field or error_param(str(e), body, STRUCTURED_FIELDS)) from None


def error_param(message: str, body: dict, names, default: str | None = None) -> str | None:
    """The field a message starts with (``response_format.json_schema.schema: ...``), when it
    is one of ``names``; else the first of ``names`` in ``body``, else ``default``."""
    head = re.match(r"'?([A-Za-z_][\w.\[\]]*)", message)
    if head and head.group(1).split(".")[0].split("[")[0] in names:
        return head.group(1)
    return next((k for k in names if body.get(k) is not None), default)


def _common(body: dict, allowed: set[str], model: str, lim: V.Limits) -> dict:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unrecognized request argument(s): {', '.join(unknown[:5])}", unknown[0])
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise bad("'model' must be a string", "model")
    if name not in (None, model):
        raise ApiError(404, f"the model '{str(name)[:100]}' does not exist; this server serves "
                            f"'{model}' (GET /v1/models)", param="model",
                       code="model_not_found")
    for name in ("logit_bias",):
        if body.get(name) not in (None, {}):
            raise bad(f"'{name}' is not supported by this server", name)
    # OpenAI's prompt-caching hints: accepted, no effect (every request's prefix is looked up
    # in the prefix cache, whatever its key; blocks stay while the pool holds them)
    for name in ("user", "prompt_cache_key", "prompt_cache_retention"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad(f"'{name}' must be a string", name)
        if len(body.get(name) or "") > _MAX_HINT_CHARS:
            raise bad(f"'{name}' has over {_MAX_HINT_CHARS} characters", name)
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict)
                           or set(so) - {"include_usage", "include_obfuscation"}):
        raise bad("'stream_options' must be an object with at most 'include_usage' and "
                  "'include_obfuscation'", "stream_options")
    _bool(so or {}, "include_obfuscation", False)  # (no obfuscation padding is sent)
    stream = _bool(body, "stream", False)
    if so is not None and not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    c = lim.cfg
    return dict(
        stream=stream,
        include_usage=_bool(so or {}, "include_usage", False),
        n=_int(body, "n", 1, 1, c.max_n),
        sampling=_sampling_values(body),
        ignore_eos=_bool(body, "ignore_eos", False),
        stop=_stop(body, lim))


def _sampling_values(body: dict) -> dict:
    try:
        values = RM.from_json(body)
    except InvalidArgument as e:
        raise bad(str(e), e.field) from None
    seed = values["seed"]  # OpenAI clients send negative seeds too: they wrap (mod 2^64)
    if seed is not None and not -(1 << 63) <= seed <= (1 << 64) - 1:
        raise bad(f"'seed' is {seed}; it must be in [-2^63, 2^64)", "seed")
    return values


def _requests(prompts: list[list[int]], opts: dict, max_tokens: int | None, logprobs: bool,
              top_logprobs: int, rid: str, lim: V.Limits,
              lookup: tuple[int, ...] = ()) -> list[GenerateRequest]:
    n = opts["n"]
    if len(prompts) * n > lim.cfg.max_n:
        raise bad(f"{len(prompts)} prompts x n={n} choices is over the limit of "
                  f"{lim.cfg.max_n} choices per request", "n")
    out = []
    for p, ids in enumerate(prompts):
        for j in range(n):
            values = dict(opts["sampling"])
            if values["seed"] is not None:  # distinct, reproducible choices
                values["seed"] = (values["seed"] + p * n + j) % (1 << 64)
            try:
                sampling = RM.sampling_params(values, lim, prefix="", quote="'")
                stopping = V.stop_params(prompt_len=len(ids), max_new_tokens=max_tokens or 0,
                                         min_new_tokens=0, stop=opts["stop"], stop_token_ids=(),
                                         ignore_eos=opts["ignore_eos"], lim=lim)
            except InvalidArgument as e:
                raise bad(str(e).replace("stopping.max_new_tokens", "max_tokens"),
                          e.field) from None
            output = OutputParams(logprobs=logprobs, top_logprobs=top_logprobs)
            out.append(GenerateRequest(ids, sampling, stopping, output,
                                       request_id=rid if len(prompts) * n == 1
                                       else f"{rid}-{p * n + j}", lookup_ids=lookup))
    return out


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None,
                lim: V.Limits, lo: int = 1) -> int | None:
    v = default
    for name in names:
        got = _int(body, name, None, lo, lim.cfg.max_new_tokens)
        if got is not None:
            v = got
    return v


def prompt_logprobs(body: dict, lim: V.Limits) -> int | None:
    """vLLM's ``prompt_logprobs``: top-n per prompt token (0: the prompt token's own only)."""
    return _int(body, "prompt_logprobs", None, 0, lim.cfg.max_top_logprobs)


def parse_completion(body: dict, prompts: Prompts, model: str, rid: str) -> Parsed:
    lim = prompts.lim
    opts = _common(body, COMPLETION_FIELDS, model, lim)
    if opts["stop"]:  # (matched in the output's text)
        prompts.need_tokenizer("a stop string")
    echo = _bool(body, "echo", False)
    if body.get("suffix") is not None:
        raise bad("'suffix' is not supported by this server", "suffix")
    best_of = _int(body, "best_of", None, 1, lim.cfg.max_n)
    if best_of is not None and best_of != opts["n"]:
        raise bad("'best_of' other than n is not supported by this server", "best_of")
    n_lp = _int(body, "logprobs", None, 0, lim.cfg.max_top_logprobs)
    p_lp = prompt_logprobs(body, lim)
    ids, texts = _completion_prompts(body.get("prompt"), prompts, lim)
    # max_tokens 0: nothing generated, only with echo (the prompt and its logprobs, as vLLM)
    max_tokens = _max_tokens(body, ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS, lim,
                             lo=0 if echo else 1)
    spec = structured_spec(body)
    generate = max_tokens != 0
    if generate:
        # a prompt too long for the default leaves what the context allows
        reqs = _requests(ids, opts, max_tokens if body.get("max_tokens") is not None else
                         min(max_tokens, max(1, lim.max_context - max(map(len, ids)))),
                         n_lp is not None, n_lp or 0, rid, lim)
    else:
        if len(ids) * opts["n"] > lim.cfg.max_n:
            raise bad(f"{len(ids)} prompts x n={opts['n']} choices is over the limit of "
                      f"{lim.cfg.max_n} choices per request", "n")
        check_echo_prompts(ids, lim)
        reqs = []
    parsed = Parsed(model, opts["stream"], opts["include_usage"], opts["n"], reqs,
                    n_lp is not None, n_lp or 0, spec=spec, echo=echo, prompt_logprobs=p_lp,
                    prompt_ids=ids, generate=generate)
    if echo:
        if any(t is None for t in texts):
            prompts.need_tokenizer("echo of a token-id prompt")
        parsed.prompt_texts = [t if t is not None else prompts.tok.decode(i)
                               for t, i in zip(texts, ids)]
    if parsed.scores_prompt:
        check_prompt_scores(ids, lim)
    return parsed


def check_echo_prompts(ids: list[list[int]], lim: V.Limits) -> None:
    """The prompts of a request that generates nothing (max_tokens 0 with echo): each one
    has a token and fits the context, as a generating request's must."""
    for i, p in enumerate(ids):
        which = "the prompt" if len(ids) == 1 else f"prompt {i}"
        if not p:
            raise bad(f"{which} is empty (it needs at least 1 token)", "prompt")
        if len(p) > lim.max_context:
            raise bad(f"{which} has {len(p)} tokens; the context limit is {lim.max_context}",
                      "prompt")


def check_prompt_scores(ids: list[list[int]], lim: V.Limits) -> None:
    """The prompts' own logprobs run through the engine's Score path: its bounds."""
    total = sum(map(len, ids))
    if total > lim.cfg.max_score_tokens:
        raise bad(f"the prompts have {total} tokens; prompt logprobs (echo with logprobs, "
                  f"prompt_logprobs) are served for up to {lim.cfg.max_score_tokens} in all",
                  "prompt")


def _completion_prompts(p: Any, prompts: Prompts, lim: V.Limits
                        ) -> tuple[list[list[int]], list[str | None]]:
    """(ids, text) per prompt; text None for a token-id prompt."""
    if p is None:
        raise bad("'prompt' is required", "prompt")
    try:
        if isinstance(p, str):
            return [prompts.text(p, "prompt")], [p]
        if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool)
                                             for x in p):
            return [prompts.ids(p, "prompt")], [None]
        if isinstance(p, list) and p and len(p) <= lim.cfg.max_n:
            if all(isinstance(x, str) for x in p):
                return [prompts.text(x, f"prompt[{i}]") for i, x in enumerate(p)], list(p)
            if all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in x) for x in p):
                return ([prompts.ids(x, f"prompt[{i}]") for i, x in enumerate(p)],
                        [None] * len(p))
    except InvalidArgument as e:
        raise bad(str(e), "prompt") from None
    if isinstance(p, list) and len(p) > lim.cfg.max_n:
        raise bad(f"'prompt' has {len(p)} prompts; the limit is {lim.cfg.max_n}", "prompt")
    raise bad("'prompt' must be a string, an array of strings, an array of token ids or an "
              "array of arrays of token ids (non-empty)", "prompt")


def chat_messages(v: Any, lim: V.Limits) -> list[dict]:
    """The request's messages as the template receives them: text parts joined by newlines, a null
    content "" (kept null beside ``tool_calls``); the other keys are checked by
    ``Prompts.check_messages`` (``chat_messages.MESSAGE_KEYS``)."""
    if not isinstance(v, list) or not v:
        raise bad("'messages' must be a non-empty array of {role, content} objects",
                  "messages")
    if len(v) > lim.cfg.max_chat_messages:
        raise bad(f"'messages' has {len(v)} messages; the limit is {lim.cfg.max_chat_messages}",
                  "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        extra = set(m) - MESSAGE_KEYS
        if extra:
            raise bad(f"messages[{i}] has unsupported fields: {', '.join(sorted(extra))}",
                      "messages")
        content = m.get("content")
        if content is None:
            content = None if m.get("tool_calls") else ""
        elif isinstance(content, list):  # text parts
            if not all(isinstance(part, dict) and part.get("type") == "text"
                       and isinstance(part.get("text"), str) for part in content):
                raise bad(f"messages[{i}].content parts must be {{type: 'text', text}} (only "
                          "text is supported)", "messages")
            # one string, as vLLM hands a text-only message to the template (its
            # chat_utils: "\n".join of the parts)
            content = "\n".join(part["text"] for part in content)
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or an array of text parts",
                      "messages")
        out.append({**m, "content": content})
    return out

"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) -> domain
``GenerateRequest``s, every field type-checked and bounded. Errors are ``ApiError``s that carry
OpenAI's error shape (HTTP status, message, type, param, code). No HTTP library here."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from . import request_map as RM
from . import validation as V
from .domain import (FailedPrecondition, GenerateRequest, InvalidArgument, OutputParams,
                     ServingError, Unimplemented)
from .prompts import Prompts

# the sampling fields come from the one request mapping (request_map.SAMPLING_FIELDS)
_COMMON = {"model", "max_tokens", "n", "stream", "stream_options", "stop", "user",
           "logit_bias", "ignore_eos"} | RM.FIELD_NAMES
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                         "response_format", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


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
        return ApiError(400, str(e), code="failed_precondition")
    if isinstance(e, Unimplemented):
        return ApiError(400, str(e), code="unsupported")
    return ApiError(400, str(e))


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
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("'user' must be a string", "user")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage"}):
        raise bad("'stream_options' must be an object with at most 'include_usage'",
                  "stream_options")
    c = lim.cfg
    return dict(
        stream=_bool(body, "stream", False),
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
              top_logprobs: int, rid: str, lim: V.Limits) -> list[GenerateRequest]:
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
                                       else f"{rid}-{p * n + j}"))
    return out


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None,
                lim: V.Limits) -> int | None:
    v = default
    for name in names:
        got = _int(body, name, None, 1, lim.cfg.max_new_tokens)
        if got is not None:
            v = got
    return v


def parse_completion(body: dict, prompts: Prompts, model: str, rid: str) -> Parsed:
    lim = prompts.lim
    opts = _common(body, COMPLETION_FIELDS, model, lim)
    if _bool(body, "echo", False):
        raise bad("'echo' is not supported by this server", "echo")
    if body.get("suffix") is not None:
        raise bad("'suffix' is not supported by this server", "suffix")
    best_of = _int(body, "best_of", None, 1, lim.cfg.max_n)
    if best_of is not None and best_of != opts["n"]:
        raise bad("'best_of' other than n is not supported by this server", "best_of")
    n_lp = _int(body, "logprobs", None, 0, lim.cfg.max_top_logprobs)
    ids = _completion_prompts(body.get("prompt"), prompts, lim)
    max_tokens = _max_tokens(body, ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS, lim)
    # a prompt too long for the default leaves what the context allows
    reqs = _requests(ids, opts, max_tokens if body.get("max_tokens") is not None else
                     min(max_tokens, max(1, lim.max_context - max(map(len, ids)))),
                     n_lp is not None, n_lp or 0, rid, lim)
    return Parsed(model, opts["stream"], opts["include_usage"], opts["n"], reqs,
                  n_lp is not None, n_lp or 0)


def _completion_prompts(p: Any, prompts: Prompts, lim: V.Limits) -> list[list[int]]:
    if p is None:
        raise bad("'prompt' is required", "prompt")
    try:
        if isinstance(p, str):
            return [prompts.text(p, "prompt")]
        if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool)
                                             for x in p):
            return [prompts.ids(p, "prompt")]
        if isinstance(p, list) and p and len(p) <= lim.cfg.max_n:
            if all(isinstance(x, str) for x in p):
                return [prompts.text(x, f"prompt[{i}]") for i, x in enumerate(p)]
            if all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in x) for x in p):
                return [prompts.ids(x, f"prompt[{i}]") for i, x in enumerate(p)]
    except InvalidArgument as e:
        raise bad(str(e), "prompt") from None
    if isinstance(p, list) and len(p) > lim.cfg.max_n:
        raise bad(f"'prompt' has {len(p)} prompts; the limit is {lim.cfg.max_n}", "prompt")
    raise bad("'prompt' must be a string, an array of strings, an array of token ids or an "
              "array of arrays of token ids (non-empty)", "prompt")


def chat_messages(v: Any, lim: V.Limits) -> list[tuple[str, str]]:
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
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad(f"messages[{i}] has unsupported fields: {', '.join(sorted(extra))}",
                      "messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # text parts
            if not all(isinstance(part, dict) and part.get("type") == "text"
                       and isinstance(part.get("text"), str) for part in content):
                raise bad(f"messages[{i}].content parts must be {{type: 'text', text}} (only "
                          "text is supported)", "messages")
            content = "".join(part["text"] for part in content)
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or an array of text parts",
                      "messages")
        out.append((m["role"], content))
    return out


def parse_chat(body: dict, prompts: Prompts, model: str, rid: str) -> Parsed:
    lim = prompts.lim
    opts = _common(body, CHAT_FIELDS, model, lim)
    for name in ("tools", "tool_choice"):
        if body.get(name) not in (None, [], "none"):
            raise bad(f"'{name}' is not supported by this server (no tool calling)", name)
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise bad("'response_format' other than {\"type\": \"text\"} is not supported",
                  "response_format")
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, 0, lim.cfg.max_top_logprobs)
    if top and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    messages = chat_messages(body.get("messages"), lim)
    try:
        ids = prompts.chat(messages, add_generation_prompt=True)
    except FailedPrecondition:
        raise
    except InvalidArgument as e:
        raise bad(str(e), "messages") from None
    max_tokens = _max_tokens(body, ("max_tokens", "max_completion_tokens"), None, lim)
    reqs = _requests([ids], opts, max_tokens, logprobs, top, rid, lim)
    return Parsed(model, opts["stream"], opts["include_usage"], opts["n"], reqs, logprobs, top)

"""vLLM's tokenizer endpoints for the HTTP API (aiohttp), which lm-evaluation-harness's
remote-tokenizer mode and other vLLM clients use:

    POST /tokenize        {"model"?, "prompt": str, "add_special_tokens"?: true,
                           "return_token_strs"?: false}
                       or {"model"?, "messages": [...], "add_generation_prompt"?: true,
                           "continue_final_message"?: false, "add_special_tokens"?: false, ...}
                          -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"model"?, "tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info  -> the tokenizer's configuration (eos/bos/pad/unk tokens, their ids,
                             add_bos_token/add_eos_token, model_max_length, chat_template,
                             tokenizer_class), as vLLM's endpoint returns it

Errors are raised as the HTTP API's ``ApiError`` (its middleware writes OpenAI's error body;
its auth middleware guards these routes too). Tokenization runs off the event loop.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from pathlib import Path

from aiohttp import web

from kvserve.artifact.manifest import TOKENIZER_CONFIG

from .chat_template import MAX_TEMPLATE_FILE_BYTES, SPECIAL_TOKENS
from .domain import ServingError
from .openai_requests import ApiError, bad, chat_messages, check_json_body, \
    from_serving_error, parse_json

TOKENIZE_PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}
INFO_KEYS = ("tokenizer_class", "add_bos_token", "add_eos_token", "clean_up_tokenization_spaces",
             "model_max_length", "padding_side", "truncation_side", "split_special_tokens")


def read_tokenizer_config(artifact_dir: str | Path) -> dict:
    """The artifact's tokenizer_config.json as a dict ({} when absent, too big or broken:
    the chat template's loader reports those)."""
    path = Path(artifact_dir) / TOKENIZER_CONFIG
    try:
        if not path.is_file() or path.stat().st_size > MAX_TEMPLATE_FILE_BYTES:
            return {}
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def tokenizer_info(tokenizer_config: dict, tokenizer, max_model_len: int,
                   eos_token_id: int | None = None) -> dict:
    """The /tokenizer_info body from the artifact's tokenizer_config.json (special tokens as
    strings, AddedToken dicts unwrapped) and the tokenizer (their ids). ``eos_token`` is always
    present (lm-eval checks for the key); without one in the config it is the model's
    ``eos_token_id`` token."""
    out: dict[str, Any] = {k: tokenizer_config[k] for k in INFO_KEYS if k in tokenizer_config}
    for k in SPECIAL_TOKENS:
        v = tokenizer_config.get(k)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[k] = v
    if "eos_token" not in out:
        out["eos_token"] = (tokenizer.id_to_token(eos_token_id)
                            if eos_token_id is not None else None)
    for k in list(SPECIAL_TOKENS):
        if isinstance(out.get(k), str):
            out[f"{k}_id"] = tokenizer.token_to_id(out[k])
    out["model_max_length"] = int(max_model_len)
    out.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, (str, list)):
        out["chat_template"] = template
    return out


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false", name)
    return v


def _check_fields(body: dict, allowed: set[str], model: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unrecognized request argument(s): {', '.join(unknown[:5])}", unknown[0])
    m = body.get("model")
    if m is not None and m != model:
        raise ApiError(404, f"the model '{str(m)[:100]}' does not exist", param="model",
                       code="model_not_found")


class TokenizeApi:
    def __init__(self, prompts, info: dict, model_name: str,
                 gate: Callable[[], None] = lambda: None):
        self.prompts, self.info, self.model, self.gate = prompts, info, model_name, gate

    def tokenize_body(self, body: dict) -> dict:
        p = self.prompts
        if "messages" in body:
            _check_fields(body, TOKENIZE_CHAT_FIELDS, self.model)
            agp = _flag(body, "add_generation_prompt", True)
            cont = _flag(body, "continue_final_message", False)
            if agp and cont and "add_generation_prompt" in body:
                raise bad("'continue_final_message' and 'add_generation_prompt' cannot both be "
                          "true", "continue_final_message")
            specials = _flag(body, "add_special_tokens", False)
            msgs = chat_messages(body["messages"], p.lim)
            text = p.render(msgs, add_generation_prompt=agp and not cont,
                            continue_final_message=cont)
            ids = p.text(text, "the rendered chat prompt", add_special_tokens=specials)
        else:
            _check_fields(body, TOKENIZE_PROMPT_FIELDS, self.model)
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad("'prompt' must be a string (or send 'messages')", "prompt")
            ids = p.text(prompt, "prompt", add_special_tokens=_flag(body, "add_special_tokens",
                                                                    True))
        out = {"count": len(ids), "max_model_len": p.lim.max_context, "tokens": ids,
               "token_strs": None}
        if _flag(body, "return_token_strs", False):
            out["token_strs"] = [p.tok.id_to_token(i) for i in ids]
        return out

    def detokenize_body(self, body: dict) -> dict:
        _check_fields(body, DETOKENIZE_FIELDS, self.model)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                               for t in tokens):
            raise bad("'tokens' must be an array of token ids", "tokens")
        ids = self.prompts.ids(tokens, "tokens")
        return {"prompt": self.prompts.tok.decode(ids)}

    async def _run(self, request: web.Request, work: Callable[[dict], dict]) -> web.Response:
        self.gate()
        check_json_body(request.headers)
        raw = await request.read()

        def call() -> dict:
            try:
                return work(parse_json(raw))
            except ServingError as e:
                raise from_serving_error(e) from None

        out = await asyncio.get_running_loop().run_in_executor(None, call)
        return web.Response(text=json.dumps(out, ensure_ascii=False),
                            content_type="application/json")

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._run(request, self.tokenize_body)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._run(request, self.detokenize_body)

    async def get_info(self, request: web.Request) -> web.Response:
        self.gate()
        return web.Response(text=json.dumps(self.info, ensure_ascii=False),
                            content_type="application/json")


def add_tokenize_routes(app: web.Application, prompts, info: dict, model_name: str,
                        gate: Callable[[], None] = lambda: None) -> TokenizeApi:
    """Adds POST /tokenize, POST /detokenize and GET /tokenizer_info to ``app`` (before it
    starts). ``info``: ``tokenizer_info(...)``; ``gate``: raises ApiError 503 while the server
    loads or drains (the HTTP API's ``_gate``)."""
    api = TokenizeApi(prompts, info, model_name, gate)
    app.add_routes([web.post("/tokenize", api.tokenize), web.post("/detokenize", api.detokenize),
                    web.get("/tokenizer_info", api.get_info)])
    return api

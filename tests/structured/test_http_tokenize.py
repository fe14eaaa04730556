"""server/http_tokenize.py: vLLM's /tokenize, /detokenize and /tokenizer_info on a real aiohttp
server on loopback, inside the HTTP API's own app (its error and bearer-token middlewares),
with the real Qwen3 and Gemma 2 tokenizers; compared with transformers; driven the way
lm-evaluation-harness's RemoteTokenizer drives them."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
import requests

from kvserve.model.tokenizer import Tokenizer
from kvserve.server.chat_template import ChatTemplate
from kvserve.server.config import ServerConfig
from kvserve.server.http_api import OpenAIApi
from kvserve.server.http_tokenize import add_tokenize_routes, tokenizer_info
from kvserve.server.openai_requests import ApiError
from kvserve.server.prompts import Prompts
from kvserve.server.validation import Limits
from npm_tokenizers import npm_tokenizer_dir

transformers = pytest.importorskip("transformers")
TOKEN = "tok-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Served:
    """An aiohttp app on a loopback port, on its own loop thread."""

    def __init__(self, app):
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(30)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def _serve(d, model="m", ready=lambda: True):
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(d / "tokenizer.json")
    lim = Limits.make(ServerConfig(max_prompt_chars=20_000), tok.vocab_size + 64, 1, 1, 4096)
    prompts = Prompts(tok, lim, ChatTemplate.from_tokenizer_config(cfg))
    api = OpenAIApi(None, prompts, None, None, None, model, 0, auth_token=TOKEN)
    app = api.app(1 << 20)

    def gate():
        if not ready():
            raise ApiError(503, "the model is still loading; retry shortly",
                           "service_unavailable", code="service_unavailable")

    add_tokenize_routes(app, prompts, tokenizer_info(cfg, tok, lim.max_context), model, gate)
    return Served(app)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    s = _serve(qwen3_dir)
    yield s, transformers.AutoTokenizer.from_pretrained(str(qwen3_dir), local_files_only=True)
    s.close()


@pytest.fixture(scope="module")
def gemma2():
    d = npm_tokenizer_dir("gemma2")
    s = _serve(d)
    yield s, transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    s.close()


def post(s, path, body, headers=AUTH):
    return requests.post(s.url + path, json=body, headers=headers, timeout=30)


def test_tokenize_prompt_as_transformers(gemma2):
    s, ref = gemma2
    r = post(s, "/tokenize", {"model": "m", "prompt": "Hello, world!"})
    assert r.status_code == 200
    assert r.json() == {"count": 5, "max_model_len": 4096,
                        "tokens": [2, 4521, 235269, 2134, 235341], "token_strs": None}
    r = post(s, "/tokenize", {"prompt": "Hello, world!", "add_special_tokens": False,
                              "return_token_strs": True})
    assert r.json()["tokens"] == ref("Hello, world!", add_special_tokens=False)["input_ids"]
    assert r.json()["token_strs"] == ["Hello", ",", "▁world", "!"]


def test_tokenize_messages_as_apply_chat_template(qwen3):
    s, ref = qwen3
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本 hi"}]
    for agp in (True, False):
        r = post(s, "/tokenize", {"messages": msgs, "add_generation_prompt": agp})
        want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=agp)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert r.status_code == 200 and r.json()["tokens"] == want
        assert r.json()["count"] == len(want)
    cont = msgs + [{"role": "assistant", "content": "The answer is"}]
    r = post(s, "/tokenize", {"messages": cont, "add_generation_prompt": False,
                              "continue_final_message": True})
    text = ref.apply_chat_template(cont, tokenize=False, continue_final_message=True)
    assert text.endswith("The answer is")
    assert r.json()["tokens"] == ref(text, add_special_tokens=False)["input_ids"]


def test_text_parts_are_joined_by_newlines(qwen3):
    """A message's content as text parts is one string to the template, the parts joined by
    "\n" (vLLM's chat_utils does the same for a text-only message)."""
    s, ref = qwen3
    parts = [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second."}]
    r = post(s, "/tokenize", {"messages": [{"role": "user", "content": parts}]})
    want = ref.apply_chat_template([{"role": "user", "content": "First part.\nSecond."}],
                                   tokenize=True, add_generation_prompt=True)
    assert r.json()["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)


def test_detokenize(qwen3):
    s, ref = qwen3
    ids = ref("naïve café 😀 <|im_end|>", add_special_tokens=False)["input_ids"]
    r = post(s, "/detokenize", {"model": "m", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "naïve café 😀 <|im_end|>"}


def test_tokenizer_info_is_what_lm_eval_reads(qwen3, gemma2):
    s, _ = qwen3
    info = requests.get(s.url + "/tokenizer_info", headers=AUTH, timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and info["eos_token_id"] == 151645
    assert info["pad_token"] == "<|endoftext|>" and "bos_token" not in info
    assert info["tokenizer_class"] == "Qwen2Tokenizer" and info["model_max_length"] == 4096
    assert "<tool_call>" in info["chat_template"]
    g, _ = gemma2
    info = requests.get(g.url + "/tokenizer_info", headers=AUTH, timeout=30).json()
    assert (info["bos_token"], info["bos_token_id"], info["add_bos_token"]) == ("<bos>", 2, True)
    # lm-eval's RemoteTokenizer: eos id = encode(eos_token)[0] with add_special_tokens false
    r = post(g, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert r.json()["tokens"] == [info["eos_token_id"]] == [1]


@pytest.mark.parametrize("path, body, status, message", [
    ("/tokenize", {"prompt": 3}, 400, "'prompt' must be a string"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "must be true or false"),
    ("/tokenize", {"prompt": "x", "frob": 1}, 400, "unrecognized request argument"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "the model 'other' does not exist"),
    ("/tokenize", {"prompt": "x" * 20_001}, 400, "the limit is 20000"),
    ("/tokenize", {"messages": []}, 400, "'messages' must be a non-empty array"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "add_generation_prompt": True, "continue_final_message": True},
     400, "cannot both be true"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": "12"}, 400, "'tokens' must be an array of token ids"),
    ("/detokenize", {"tokens": [True]}, 400, "'tokens' must be an array of token ids"),
])
def test_bad_requests(qwen3, path, body, status, message):
    s, _ = qwen3
    r = post(s, path, body)
    assert r.status_code == status
    assert message in r.json()["error"]["message"]


def test_auth_body_and_media_type(qwen3):
    s, _ = qwen3
    assert post(s, "/tokenize", {"prompt": "x"}, headers={}).status_code == 401
    assert requests.get(s.url + "/tokenizer_info", timeout=30).status_code == 401
    r = requests.post(s.url + "/tokenize", data=b"{not json", timeout=30,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = requests.post(s.url + "/tokenize", data=b"x", timeout=30,
                      headers={**AUTH, "Content-Type": "text/plain"})
    assert r.status_code == 415


def test_not_ready_is_503(qwen3_dir):
    s = _serve(qwen3_dir, ready=lambda: False)
    try:
        r = post(s, "/tokenize", {"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        assert requests.get(s.url + "/tokenizer_info", headers=AUTH, timeout=30).status_code \
            == 503
    finally:
        s.close()


def test_lm_eval_remote_tokenizer(qwen3, gemma2):
    """lm-evaluation-harness's own client (lm_eval.utils, 0.4.13) in remote-tokenizer mode."""
    le = pytest.importorskip("lm_eval.utils")
    for s, ref in (qwen3, gemma2):
        base = s.url + "/v1/completions"
        assert le.check_remote_tokenizer_support(base, auth_token=TOKEN)
        rt = le.RemoteTokenizer(base, auth_token=TOKEN)
        text = "The capital of France is Paris. 日本"
        assert rt.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
        assert rt.decode(rt.encode(text)) == text
        assert rt.eos_token_id == ref.eos_token_id
        assert rt.bos_token_id == ref.bos_token_id
    assert not le.check_remote_tokenizer_support(qwen3[0].url + "/v1/completions",
                                                 auth_token="wrong", max_retries=1)


def test_read_tokenizer_config(tmp_path, qwen3_dir):
    from kvserve.server.http_tokenize import read_tokenizer_config

    assert read_tokenizer_config(qwen3_dir)["eos_token"] == "<|im_end|>"
    assert read_tokenizer_config(tmp_path) == {}
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    assert read_tokenizer_config(tmp_path) == {}
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    assert read_tokenizer_config(tmp_path) == {}


def test_tokenizer_info_without_an_eos_in_the_config(bpe):
    info = tokenizer_info({}, bpe, 128, eos_token_id=bpe.eos_id)
    assert info == {"eos_token": "<|endoftext|>", "eos_token_id": bpe.eos_id,
                    "model_max_length": 128, "tokenizer_class": "PreTrainedTokenizerFast"}
    assert tokenizer_info({}, bpe, 128)["eos_token"] is None

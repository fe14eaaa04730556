"""Every text path tokenizes as transformers' AutoTokenizer does, BOS included, on a model
whose tokenizer.json's post-processor adds a BOS (as Llama's and Gemma's do): gRPC Tokenize
and Score texts, HTTP /tokenize, and completions' text prompts (their echo lists the tokens);
a chat's rendered prompt gets no second BOS (the template writes its own)."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from kvserve_testing import (CHATML_TOKENS, SEED, Artifact, chat_tokenizer,  # noqa: E402
                             ready_channel, running_app)

TEXTS = ["Hello, world!", "def add(a, b):\n    return a + b", " leading space"]
BOS = "<bos>"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + "
            "m['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _bos_tokenizer():
    from tokenizers import processors

    tok = chat_tokenizer(CHATML_TOKENS + (BOS,))
    hf = tok._tok
    bos = hf.token_to_id(BOS)
    hf.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                      pair=f"{BOS} $A {BOS} $B",
                                                      special_tokens=[(BOS, bos)])
    return tok


@pytest.fixture(scope="module")
def bos_app(tmp_path_factory):
    import torch

    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.checkpoint import TOKENIZER_CONFIG, save_checkpoint
    from kvserve.model.config import preset
    from kvserve.model.transformer import Transformer

    root = tmp_path_factory.mktemp("bos")
    tok = _bos_tokenizer()
    cfg = preset("tiny", vocab_size=tok.vocab_size, eos_token_id=tok.eos_id,
                 pad_token_id=tok.pad_id, init_std=0.1)
    torch.manual_seed(SEED)
    model = Transformer(cfg).eval()
    tc = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": BOS}
    ckpt = save_checkpoint(root / "ckpt", model, tokenizer_json=tok.to_str(),
                           extra_files={TOKENIZER_CONFIG: json.dumps(tc).encode()})
    out = export_artifacts(ckpt, root / "artifact", attention=False, precision="fp32",
                           progress=False, threads=2)
    art = Artifact(Path(out), model, tok, cfg)
    (root / "hf").mkdir()
    (root / "hf" / "tokenizer.json").write_text(tok.to_str())
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {**tc, "tokenizer_class": "PreTrainedTokenizerFast"}))
    ref = transformers.AutoTokenizer.from_pretrained(str(root / "hf"))
    with running_app(art, http_port=0) as app:
        yield app, ref


def _http(app, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{app.http_port}{path}",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_every_text_path_adds_the_bos_as_transformers(bos_app):
    from kvserve.v1 import inference_pb2 as pb
    from kvserve.v1 import inference_pb2_grpc as pb_grpc

    app, ref = bos_app
    want = [ref(t)["input_ids"] for t in TEXTS]
    bos = ref.convert_tokens_to_ids(BOS)
    assert all(w[0] == bos and w.count(bos) == 1 for w in want)
    with ready_channel(app.port) as ch:
        stub = pb_grpc.InferenceStub(ch)
        got = stub.Tokenize(pb.TokenizeRequest(texts=TEXTS), timeout=30)
        assert [list(t.ids) for t in got.tokens] == want
        scored = stub.Score(pb.ScoreRequest(texts=TEXTS), timeout=60)
        assert [s.token_count for s in scored.sequences] == [len(w) for w in want]
    for text, ids in zip(TEXTS, want):
        assert _http(app, "/tokenize", {"prompt": text})["tokens"] == ids
        r = _http(app, "/v1/completions", {"prompt": text, "echo": True, "logprobs": 0,
                                           "max_tokens": 0})
        assert r["usage"]["prompt_tokens"] == len(ids)
        assert r["choices"][0]["logprobs"]["tokens"][0] == BOS


def test_a_chat_gets_one_bos(bos_app):
    app, ref = bos_app
    messages = [{"role": "user", "content": "Hello"}]
    want = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    r = _http(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                            "prompt_logprobs": 0})
    plp = r["prompt_logprobs"]
    assert [int(next(iter(d))) for d in plp[1:]] == want[1:]
    assert r["usage"]["prompt_tokens"] == len(want)
    assert want.count(ref.convert_tokens_to_ids(BOS)) == 1

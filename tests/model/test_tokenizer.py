"""Byte-level BPE: exact round trips, special tokens, persistence, determinism, no torch."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.tokenizer import EOS, PAD, Tokenizer, train_bpe

HARD = [
    "", " ", "   ", "  leading", "trailing  ", "a  b   c", "\n", "\n\n\n", "\t\tx\t",
    "\r\n", "\x00", "a\x00b", "\x01\x02\x1b[0m\x7f", "😀", "👍🏽👨‍👩‍👧", "日本語のテキスト",
    "ÅÄÖ naïve", "\u200b\ufeff", "tab\tand space ", "def f():\n    return 1\n",
    EOS, f"a{EOS}b{PAD}", "<|endoftext", "\U0010ffff",
]


@pytest.mark.parametrize("text", HARD)
def test_round_trip_hard_cases(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tiny_tokenizer.vocab_size for i in ids)
    assert tiny_tokenizer.decode(ids) == text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_round_trip_any_utf8(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


def test_special_tokens_and_size(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.eos_id != tok.pad_id
    assert tok.encode(EOS) == [tok.eos_id]
    assert tok.encode(PAD) == [tok.pad_id]
    assert 258 < tok.vocab_size <= 320
    # merges learned: a frequent word is fewer tokens than bytes
    assert len(tok.encode("return")) < len(b"return")


def test_every_byte_is_a_token(tiny_tokenizer):
    for b in range(256):
        s = bytes([b]).decode("latin-1")
        assert tiny_tokenizer.decode(tiny_tokenizer.encode(s)) == s


def test_save_load_and_determinism(tiny_tokenizer, tiny_docs, tmp_path):
    path = tmp_path / "tokenizer.json"
    tiny_tokenizer.save(path)
    loaded = Tokenizer.from_file(path)
    assert loaded.to_str() == tiny_tokenizer.to_str()
    text = "def add(a, b):\n    return a + b  # 😀\n"
    assert loaded.encode(text) == tiny_tokenizer.encode(text)
    assert Tokenizer.from_str(tiny_tokenizer.to_str()).vocab_size == tiny_tokenizer.vocab_size
    again = train_bpe(tiny_docs, vocab_size=320)
    assert again.to_str() == tiny_tokenizer.to_str()


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(["abc"], vocab_size=100)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_file(tmp_path / "missing.json")


def test_module_does_not_import_torch():
    code = ("import sys, kvserve.model.tokenizer as t; tok = t.train_bpe(['ab ab'], 260); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_foreign_tokenizer_without_our_special_tokens_loads():
    """An imported model's tokenizer (e.g. Llama's, with </s> and no pad) still loads: its
    eos/pad come from the model config; only training insists on ours."""
    import pytest
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    from kvserve.model.tokenizer import Tokenizer

    raw = HFTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer(raw)
    assert tok.eos_id is None and tok.pad_id is None
    assert tok.encode("hello")
    with pytest.raises(ValueError, match="special tokens"):
        tok.require_special_tokens()


def test_chatml_tokens_are_reserved_and_the_template_comes_with_them(tiny_tokenizer):
    """Every trained tokenizer reserves ChatML's tokens (one special id each, never merged
    into text), so every trained model carries a chat template (``chat_config``)."""
    from kvserve.model.tokenizer import IM_END, IM_START
    from kvserve.server.chat_template import ChatTemplate

    tok = tiny_tokenizer
    start, end = tok.token_to_id(IM_START), tok.token_to_id(IM_END)
    assert None not in (start, end) and len({start, end, tok.eos_id, tok.pad_id}) == 4
    cfg = tok.chat_config()
    assert cfg["eos_token"] == IM_END
    text = ChatTemplate.from_tokenizer_config(cfg).render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids.count(start) == 3 and ids.count(end) == 2
    assert tok.decode(ids) == text


def test_a_tokenizer_without_chatml_has_no_chat_config():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(["ab ab"], trainers.BpeTrainer(
        vocab_size=260, special_tokens=[EOS, PAD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert Tokenizer(hf).chat_config() is None

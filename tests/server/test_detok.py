"""Unit tests of the incremental detokenizer and the stop-string matcher (no server)."""
from __future__ import annotations

import random
import re

import pytest
from tokenizers import Tokenizer as HFTokenizer

from kvserve.model.tokenizer import train_bpe
from kvserve.server.detok import IncrementalDetokenizer, StopMatcher, TokenBytes

TEXTS = ["naïve café 日本語 emoji 😀🚀 def f(x): return x\n" * 2 + str(i) for i in range(30)]


@pytest.fixture(scope="module")
def tok():
    return train_bpe(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def tb(tok):
    return TokenBytes(HFTokenizer.from_str(tok.to_str()), tok.vocab_size)


def stream(tb, ids):
    d = IncrementalDetokenizer(tb)
    deltas = [d.push(i) for i in ids]
    deltas.append(d.flush())
    return deltas


def test_byte_table_is_exact(tok, tb):
    assert tb.exact
    for i in range(tok.vocab_size):
        assert tb[i].decode("utf-8", "replace") == tok.decode([i])


def test_never_splits_a_character(tok, tb):
    text = "日本語😀 naïve"
    ids = tok.encode(text)
    # feed byte by byte: every multi-byte character arrives in pieces
    byte_ids = []
    for b in text.encode("utf-8"):
        [tid] = [i for i in range(tok.vocab_size) if tb[i] == bytes([b])]
        byte_ids.append(tid)
    deltas = stream(tb, byte_ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some bytes were held back
    assert "".join(stream(tb, ids)) == text


def test_random_ids_match_the_tokenizers_lossy_decode(tok, tb):
    rnd = random.Random(0)
    for _ in range(500):
        ids = [rnd.randrange(tok.vocab_size) for _ in range(rnd.randrange(1, 16))]
        assert "".join(stream(tb, ids)) == tok.decode(ids)


def run_stops(pieces, stops):
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        r = m.push(p)
        out.append(r.text)
        if r.stop is not None:
            return "".join(out), r.stop
    return "".join(out) + m.flush(), None


@pytest.mark.parametrize("pieces,stops,want", [
    (["Hel", "lo wo", "rld"], ["o w"], ("Hell", "o w")),
    (["a", "b", "c", "d"], ["bc"], ("a", "bc")),
    (["abc"], ["x"], ("abc", None)),
    (["ab", "x"], ["abc"], ("abx", None)),  # held-back prefix released when it stops matching
    (["xx", "ab", "cd"], ["bcd", "abc"], ("xx", "abc")),  # earliest match wins
    (["END"], ["END"], ("", "END")),
    (["日本", "語!"], ["本語"], ("日", "本語")),
])
def test_stop_strings_across_pieces(pieces, stops, want):
    assert run_stops(pieces, stops) == want


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(["STOP"])
    assert m.push("abcST").text == "abc"
    assert m.push("x").text == "STx"
    assert m.push("S").text == ""
    assert m.flush() == "S"


def test_unarmed_matcher_passes_everything():
    m = StopMatcher(["ab"])
    assert m.push("xab", armed=False).text == "xab"
    r = m.push("cab")
    assert (r.text, r.stop) == ("c", "ab")


@pytest.fixture(scope="module")
def spiece():
    """A Llama-2-style tokenizer: Metaspace, byte fallback (<0xNN> tokens), Strip decoder."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1] / "families"))
    from family_models import sentencepiece_tokenizer

    return HFTokenizer.from_str(sentencepiece_tokenizer(TEXTS))


def test_sentencepiece_stream_is_exact(spiece):
    tb = TokenBytes(spiece, spiece.get_vocab_size())
    assert tb.exact
    rng = random.Random(0)
    fallbacks = 0
    for text in TEXTS[:10] + ["a  b\tc\n\n 😀 x", "ÆØÅ ß 한국어 🦀"]:
        ids = spiece.encode(text).ids
        fallbacks += sum(spiece.id_to_token(i).startswith("<0x") for i in ids)
        cuts = [c for c in range(1, len(ids))  # prompts that end on a character boundary
                if not re.fullmatch(r"<0x[89AB][0-9A-F]>", spiece.id_to_token(ids[c]))]
        cut = rng.choice(cuts)
        prompt, gen = ids[:cut], ids[cut:]
        want = spiece.decode(prompt + gen)[len(spiece.decode(prompt)):]
        assert "".join(stream(tb, gen)) == want  # the continuation, leading space included
        assert "".join(stream(tb, ids)).removeprefix(" ") == spiece.decode(ids) == text
    assert fallbacks > 4  # characters outside the vocabulary went through <0xNN> bytes


def test_sentencepiece_added_tokens_go_through_the_decoder(spiece):
    """Gemma's whitespace runs ("▁▁", ...) are added, non-special tokens: the decoder turns
    their ``▁`` into spaces like any other token's (the table used to keep them literally)."""
    from tokenizers import AddedToken

    tok = HFTokenizer.from_str(spiece.to_str())
    tok.add_tokens([AddedToken("\u2581\u2581", normalized=False, special=False)])
    tb = TokenBytes(tok, tok.get_vocab_size())
    run = tok.token_to_id("\u2581\u2581")
    assert tb[run] == b"  "
    ids = tok.encode("a b").ids + [run] + tok.encode("c").ids
    assert "".join(stream(tb, ids)).removeprefix(" ") == tok.decode(ids) == "a b   c"


def decode_stream(hf, ids, prefill=None) -> str:
    from tokenizers.decoders import DecodeStream

    s = DecodeStream(ids=prefill, skip_special_tokens=False)
    return "".join(t for t in (s.step(hf, i) for i in ids) if t is not None)


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_stream_text_equals_tokenizers_decode_stream(kind, tok, spiece):
    """The same text as ``tokenizers.decoders.DecodeStream`` (what the detokenizer was measured
    against: equal text, 2-10x cheaper per token), over random ids: special tokens, ids past
    the tokenizer (no text), UTF-8 split across tokens or invalid. DecodeStream holds invalid
    trailing bytes (and the text before them) back for good: it has no flush; ``flush`` gives
    them as U+FFFD. Random runs of ``<0xNN>`` tokens are left out for SentencePiece: there the
    whole-text decode turns every byte of an invalid run into U+FFFD (the stream: the invalid
    bytes only), and DecodeStream raises "Invalid prefix encountered" on some."""
    hf = HFTokenizer.from_str(tok.to_str()) if kind == "byte-level" else spiece
    n = hf.get_vocab_size()
    tb = TokenBytes(hf, n + 8)  # 8 ids past the tokenizer's vocabulary
    pool = [i for i in range(n + 8) if not re.fullmatch(r"<0x..>", hf.id_to_token(i) or "")]
    # a stream continues a prompt: DecodeStream prefilled with one (which ends on a character
    # boundary) keeps the leading space a Strip decoder takes off a whole text
    prefill = hf.encode("x").ids
    rnd = random.Random(0)
    if kind == "byte-level":  # 30% from the first 260 ids: single bytes, specials
        draws = [[rnd.choice(pool) if rnd.random() < 0.7 else rnd.randrange(260)
                  for _ in range(rnd.randrange(1, 16))] for _ in range(600)]
    else:  # and real text: characters outside the vocabulary in valid <0xNN> runs
        draws = [rnd.sample(pool, rnd.randrange(1, 16)) for _ in range(500)] + [
            hf.encode(t).ids for t in TEXTS[:5] + ["ÆØÅ ß 한국어 🦀", "a  b\tc\n\n 😀 x"]]
    held_back = 0
    for ids in draws:
        ours, theirs = "".join(stream(tb, ids)), decode_stream(hf, ids, prefill)
        whole = hf.decode(prefill + ids, skip_special_tokens=False)
        assert ours == whole[len(hf.decode(prefill, skip_special_tokens=False)):]
        if ours.endswith("\ufffd"):  # DecodeStream waits for a text that does not: forever
            assert ours.startswith(theirs), ids
            held_back += 1
        else:
            assert ours == theirs, ids
    assert held_back < len(draws) - 150  # most draws compare the whole text
    if kind == "byte-level":
        assert held_back > 0

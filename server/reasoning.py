"""A chat reply's reasoning apart from its answer (``kvserve serve --reasoning-parser think``):
models that think in ``<think> ... </think>`` before they answer (Qwen3, DeepSeek-R1 and its
distillations, SmolLM3) get the thought in the message's ``reasoning_content`` (as vLLM's
reasoning parsers and DeepSeek's API return it) and the answer in ``content``; tool calls
are parsed from the answer only.

The rule, the same streamed and not: the reply thinks first where it begins with ``<think>``
(after whitespace), or where the prompt ended inside a thought (a template that opens it for
the model, as DeepSeek-R1's does; an opening tag the model writes again is dropped); the
thought runs to ``</think>``, or to the end of a reply cut off while thinking. Newlines
around the thought and before the answer are the format's, not the text's (Qwen3's template
strips them when it renders the history). A reply that does not think is all content. A
constrained reply (a structured output, a forced tool call) thinks first where the tags
are the tokenizer's tokens (``constraints.after_thought``: the HTTP layer wraps the
constraint); otherwise it is constrained, and so the answer, from its first token.
"""
from __future__ import annotations

from .tool_call_stream import held_back

OPEN, CLOSE = "<think>", "</think>"


def opens_thought(prompt_tail: str) -> bool:
    """Whether a prompt ending with ``prompt_tail`` (its last few tokens' text) leaves the
    model inside a thought."""
    rest = prompt_tail.rstrip()
    return rest.endswith(OPEN) and not rest.endswith(CLOSE)


TAIL_TOKENS = 8  # a prompt's last tokens, enough for the tag and whitespace around it


def prompt_opens_thought(ids, token_bytes) -> bool:
    """``opens_thought`` of a prompt's token ids (``token_bytes``: ``detok.TokenBytes``)."""
    tail = b"".join(token_bytes[t] for t in ids[-TAIL_TOKENS:])
    return opens_thought(tail.decode("utf-8", "replace"))


NL = "\r\n"  # the newlines around a thought and before the answer: the format's


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a finished reply: ``ReasoningStream``'s pieces of the
    whole text, joined (one rule, streamed or not)."""
    stream = ReasoningStream(opened)
    parts = {"reasoning": "", "content": ""}
    for kind, piece in stream.push(text) + stream.finish():
        parts[kind] += piece
    return (parts["reasoning"] if stream.thinks else None), parts["content"]


class ReasoningStream:
    """Streamed text in, ``("reasoning" | "content", text)`` pieces out, each sent as soon as
    it is known (a tag split across tokens, and newlines that may turn out to be the format's,
    are held until they are)."""

    def __init__(self, opened: bool = False):
        self._opened = opened
        self._state = "start"
        self._buf = ""
        self._fresh = True  # nothing of the current part sent yet (its leading newlines drop)

    @property
    def thinks(self) -> bool:
        """The reply has begun a thought (an empty one too)."""
        return self._state in ("thought", "answer")

    def push(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self._state == "start":  # an opening tag (again, after a prompt that opened)?
                head = self._buf.lstrip()
                if head.startswith(OPEN):
                    self._buf, self._state = head[len(OPEN):], "thought"
                    continue
                if not head or OPEN.startswith(head):
                    return out  # whitespace, or the tag's beginning: not known yet
                self._state = "thought" if self._opened else "content"
                continue
            if self._state == "thought":
                head, closed, rest = self._buf.partition(CLOSE)
                if closed:
                    self._emit(out, "reasoning", head.rstrip(NL))
                    self._buf, self._state, self._fresh = rest, "answer", True
                    continue
                # held: the close tag's beginning, and the newlines before it
                sure = self._buf[:len(self._buf) - held_back(self._buf, CLOSE)].rstrip(NL)
                self._emit(out, "reasoning", sure)
                self._buf = self._buf[len(sure):]
                return out
            self._emit(out, "content", self._buf)  # "answer" / "content"
            self._buf = ""
            return out

    def finish(self) -> list[tuple[str, str]]:
        """What is still held, at the end of the reply."""
        buf, self._buf = self._buf, ""
        out: list[tuple[str, str]] = []
        if self._state == "start":  # (whitespace, or the tag's beginning)
            self._state = "thought" if self._opened else "content"
        if self._state == "thought":
            self._emit(out, "reasoning", buf.rstrip(NL))
        else:
            self._emit(out, "content", buf)
        return out

    def _emit(self, out: list, kind: str, text: str) -> None:
        if self._fresh and self._state != "content":
            text = text.lstrip(NL)
        if text:
            out.append((kind, text))
            self._fresh = False

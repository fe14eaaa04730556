"""Streaming tool calls: the generated text in, OpenAI chat-chunk deltas out.

``push(text)`` / ``finish()`` return a list of deltas, each either ``{"content": str}`` or
``{"tool_calls": [d]}`` where ``d`` is OpenAI's streamed tool-call delta: first
``{"index": i, "id": "call_...", "type": "function", "function": {"name": f, "arguments": ""}}``,
then ``{"index": i, "function": {"arguments": fragment}}``. A call is sent once its text is
complete and valid (for Hermes, at ``</tool_call>``; for Llama 3 JSON and Mistral, whose calls
run to the end of the output, at ``finish``), so the streamed arguments equal the non-streamed
ones exactly; text that is not a valid call is passed through as content (a malformed call
too, at ``finish``). ``calls`` says how many calls were sent (``finish_reason`` "tool_calls").
"""
from __future__ import annotations

from typing import Callable

from .tool_calls import ToolFormat, new_call_id, parse_tool_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PY_TAG = "<|python_tag|>"


def held_back(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


class ToolCallStream:
    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] = new_call_id):
        self.fmt, self.new_id = fmt, new_id
        self.calls = 0
        self._buf = ""          # text not yet sent
        self._in_call = False   # Hermes: inside <tool_call> ... ; others: capturing to the end
        self._started = False   # Llama 3: the first non-space text decides

    def push(self, text: str) -> list[dict]:
        self._buf += text
        if self.fmt is ToolFormat.HERMES:
            return self._hermes()
        if self.fmt is ToolFormat.LLAMA3_JSON:
            return self._llama3()
        return self._mistral()

    def finish(self) -> list[dict]:
        buf, self._buf = self._buf, ""
        if not buf:
            return []
        if self._in_call:
            content, calls = parse_tool_calls(buf, self.fmt, self.new_id)
            if calls:
                out = [{"content": content}] if content else []
                return out + self._send(calls)
        if self.calls and not buf.strip():
            return []  # whitespace after the calls is the format's
        return [{"content": buf}]

    # --- per format -------------------------------------------------------------------------
    def _send(self, calls: list[dict]) -> list[dict]:
        out = []
        for c in calls:
            i = self.calls
            self.calls += 1
            fn = c["function"]
            out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                        "function": {"name": fn["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
        return out

    def _hermes(self) -> list[dict]:
        out: list[dict] = []
        while True:
            if not self._in_call:
                k = self._buf.find(OPEN)
                if k < 0:
                    keep = held_back(self._buf, OPEN)
                    text, self._buf = self._buf[:len(self._buf) - keep], self._buf[
                        len(self._buf) - keep:]
                    if text.strip() or (text and not self.calls):
                        out.append({"content": text})
                    elif text:  # whitespace after a call: held until more text says what
                        self._buf = text + self._buf
                    return out
                if self._buf[:k] and (self._buf[:k].strip() or not self.calls):
                    out.append({"content": self._buf[:k]})
                self._buf, self._in_call = self._buf[k:], True
            k = self._buf.find(CLOSE)
            if k < 0:
                return out
            block, self._buf = self._buf[:k + len(CLOSE)], self._buf[k + len(CLOSE):]
            self._in_call = False
            _, calls = parse_tool_calls(block, self.fmt, self.new_id)
            out += self._send(calls) if calls else [{"content": block}]

    def _llama3(self) -> list[dict]:
        """The first non-space text decides, once: a call (``{`` or the python tag) is
        captured to the end; anything else makes the whole output content, as
        ``parse_tool_calls`` reads it."""
        if self._in_call:
            return []
        if not self._started:
            s = self._buf.lstrip()
            if not s:
                return []
            if s.startswith("{") or s.startswith(PY_TAG):
                self._in_call = self._started = True
                return []
            if PY_TAG.startswith(s):
                return []  # maybe the tag: wait
            self._started = True
        text, self._buf = self._buf, ""
        return [{"content": text}] if text else []

    def _mistral(self) -> list[dict]:
        if self._in_call:
            return []
        k = self._buf.find(MISTRAL_MARK)
        if k >= 0:
            text, self._buf, self._in_call = self._buf[:k], self._buf[k:], True
            return [{"content": text}] if text else []
        keep = held_back(self._buf, MISTRAL_MARK)
        text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return [{"content": text}] if text else []

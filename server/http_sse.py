"""The chunks of a streamed completion or chat completion (server-sent events), per choice:
the opening chunk (chat: the role; completions with ``echo``: the prompt's text and
logprobs), one chunk per token's text, streamed tool-call deltas as OpenAI streams them
(``ToolCallStream``: the name first, then the arguments), a thought apart from the answer
(``ReasoningStream``: ``reasoning_content`` deltas, with ``--reasoning-parser think``), and
the finish chunk."""
from __future__ import annotations

import json
import time

from .domain import FinishEvent, FinishReason, TokenEvent
from .reasoning import ReasoningStream
from .tool_call_stream import ToolCallStream
from .tool_calls import finish_reason

FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop",
          FinishReason.STOP_SEQUENCE: "stop", FinishReason.STOP_TOKEN: "stop",
          FinishReason.TIME_LIMIT: "length", FinishReason.CANCELLED: "stop",
          FinishReason.CONSTRAINT: "stop"}


class SseChoices:
    def __init__(self, resp, parsed, rid: str, model: str, chat: bool, n: int, lp):
        self.resp, self.parsed, self.rid, self.model, self.chat = resp, parsed, rid, model, chat
        self.n, self.lp = n, lp
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.created = 0
        self.offsets = [0] * n
        self.tools = [ToolCallStream(parsed.tool_format) for _ in range(n)] \
            if chat and parsed.tool_format is not None else None
        self.thoughts = [ReasoningStream(parsed.reasoning_open) for _ in range(n)] \
            if chat and parsed.reasoning_open is not None else None

    async def send(self, choices: list[dict], usage: dict | None = None, **extra) -> None:
        chunk = {"id": self.rid, "object": self.obj, "created": self.created,
                 "model": self.model, "choices": choices, **extra}
        if usage is not None:
            chunk["usage"] = usage
        await self.resp.write(b"data: " + json.dumps(chunk, ensure_ascii=False).encode()
                              + b"\n\n")

    async def start(self, scored: list) -> None:
        self.created = int(time.time())
        p = self.parsed
        if self.chat:
            extra = {}
            if p.prompt_logprobs is not None:
                extra["prompt_logprobs"] = self.lp.vllm_prompt(p.prompt_ids[0], scored[0],
                                                               p.prompt_logprobs)
            await self.send([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                             for i in range(self.n)], **extra)
            return
        if not p.echo and p.prompt_logprobs is None:
            return
        for i in range(self.n):
            k = i // p.n
            text = p.prompt_texts[k] if p.echo else ""
            choice = {"index": i, "text": text, "finish_reason": None,
                      "logprobs": self.lp.echo(p.prompt_ids[k], scored[k], p.top_logprobs)
                      if p.echo and p.logprobs else None}
            if p.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.lp.vllm_prompt(p.prompt_ids[k], scored[k],
                                                                p.prompt_logprobs)
            await self.send([choice])
            self.offsets[i] = len(text)

    async def token(self, i: int, ev: TokenEvent) -> None:
        p = self.parsed
        if self.chat:
            lp = self.lp.chat([ev], p.logprobs) if p.logprobs and not ev.special else None
            pieces = self.thoughts[i].push(ev.text) if self.thoughts is not None and ev.text \
                else [("content", ev.text)]
            deltas = self._chat_deltas(i, pieces)
            if not deltas and lp is not None:  # the token's logprobs: its text held by a
                # parser, or none yet (a character's first bytes)
                deltas = [{"content": ""}] if self.tools is None and self.thoughts is None \
                    else [{}]
            for k, d in enumerate(deltas):
                await self.send([{"index": i, "delta": d, "logprobs": lp if k == 0 else None,
                                  "finish_reason": None}])
            return
        want = p.logprobs and (not ev.special or p.echo)
        if not ev.text and not want:
            return
        await self.send([{"index": i, "text": ev.text, "finish_reason": None,
                          "logprobs": self.lp.completion([ev], p.logprobs, self.offsets[i],
                                                         specials=p.echo)}])
        self.offsets[i] += len(ev.text)

    def _chat_deltas(self, i: int, pieces: list[tuple[str, str]]) -> list[dict]:
        """A token's text, split into thought and answer (``pieces``), as chat deltas: the
        answer through the tool-call parser where there is one."""
        deltas: list[dict] = []
        for kind, text in pieces:
            if kind == "reasoning":
                deltas.append({"reasoning_content": text})
            elif self.tools is not None:
                deltas += self.tools[i].push(text) if text else []
            elif text:
                deltas.append({"content": text})
        return deltas

    async def finish(self, i: int, ev: FinishEvent) -> None:
        reason = FINISH[ev.reason]
        if self.chat:
            held = self._chat_deltas(i, self.thoughts[i].finish()) \
                if self.thoughts is not None else []
            if self.tools is not None:
                held += self.tools[i].finish()
                reason = finish_reason(reason, bool(self.tools[i].calls))
            for d in held:
                await self.send([{"index": i, "delta": d, "logprobs": None,
                                  "finish_reason": None}])
            await self.send([{"index": i, "delta": {}, "logprobs": None,
                              "finish_reason": reason}])
        else:
            await self.send([{"index": i, "text": "", "logprobs": None,
                              "finish_reason": reason}])

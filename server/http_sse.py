"""The chunks of a streamed completion or chat completion (server-sent events), per choice:
the opening chunk (chat: the role; completions with ``echo``: the prompt's text and
logprobs), one chunk per token's text, streamed tool-call deltas as OpenAI streams them
(``ToolCallStream``: the name first, then the arguments), and the finish chunk."""
from __future__ import annotations

import json
import time

from .domain import FinishEvent, FinishReason, TokenEvent
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
            if self.tools is None:
                deltas = [{"content": ev.text}] if ev.text or lp is not None else []
            else:
                deltas = self.tools[i].push(ev.text) if ev.text else []
                if not deltas and lp is not None:
                    deltas = [{}]  # the token's logprobs; its text held by the call parser
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

    async def finish(self, i: int, ev: FinishEvent) -> None:
        reason = FINISH[ev.reason]
        if self.chat:
            if self.tools is not None:
                for d in self.tools[i].finish():
                    await self.send([{"index": i, "delta": d, "logprobs": None,
                                      "finish_reason": None}])
                reason = finish_reason(reason, bool(self.tools[i].calls))
            await self.send([{"index": i, "delta": {}, "logprobs": None,
                              "finish_reason": reason}])
        else:
            await self.send([{"index": i, "text": "", "logprobs": None,
                              "finish_reason": reason}])

"""Prompts -> token ids, bounded: text, token ids, or chat messages rendered with the model's
chat template. Shared by the gRPC servicer and the HTTP API (plain Python values in, token ids
out; errors are domain errors)."""
from __future__ import annotations

from typing import Sequence

from . import validation as V
from .chat_template import NO_TEMPLATE, ChatTemplate
from .domain import FailedPrecondition, InvalidArgument

MAX_ROLE_CHARS = 64


class Prompts:
    def __init__(self, tokenizer, limits: V.Limits, template: ChatTemplate | None = None,
                 template_error: str = ""):
        self.tok, self.lim = tokenizer, limits
        self.template, self.template_error = template, template_error

    def text(self, text: str, name: str = "text") -> list[int]:
        return self.tok.encode(V.check_text(name, text, self.lim))

    def ids(self, ids: Sequence[int], name: str = "token_ids") -> list[int]:
        return V.check_ids(name, ids, self.lim, max_len=self.lim.max_context)

    def check_messages(self, messages: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
        c = self.lim.cfg
        if not messages:
            raise InvalidArgument("the chat has no messages (it needs at least 1)")
        if len(messages) > c.max_chat_messages:
            raise InvalidArgument(f"the chat has {len(messages)} messages; the limit is "
                                  f"{c.max_chat_messages}")
        total = 0
        out = []
        for i, (role, content) in enumerate(messages):
            if not isinstance(role, str) or not isinstance(content, str):
                raise InvalidArgument(f"messages[{i}]: role and content must be strings")
            if not role or len(role) > MAX_ROLE_CHARS or not role.isprintable():
                raise InvalidArgument(f"messages[{i}].role must be 1 to {MAX_ROLE_CHARS} "
                                      "printable characters")
            total += len(role) + len(content)
            if total > c.max_chat_chars:
                raise InvalidArgument(f"the chat's messages have over {c.max_chat_chars} "
                                      f"characters in all; the limit is {c.max_chat_chars}")
            out.append({"role": role, "content": content})
        return out

    def render(self, messages: Sequence[tuple[str, str]],
               add_generation_prompt: bool = True) -> str:
        """The chat rendered with the model's template (the prompt text)."""
        if self.template is None:
            raise FailedPrecondition(self.template_error or NO_TEMPLATE)
        msgs = self.check_messages(messages)
        return self.template.render(msgs, add_generation_prompt=add_generation_prompt)

    def chat(self, messages: Sequence[tuple[str, str]],
             add_generation_prompt: bool = True) -> list[int]:
        return self.text(self.render(messages, add_generation_prompt),
                         name="the rendered chat prompt")

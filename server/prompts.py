"""Prompts -> token ids, bounded: text, token ids, or chat messages rendered with the model's
chat template. Shared by the gRPC servicer and the HTTP API (plain Python values in, token ids
out; errors are domain errors)."""
from __future__ import annotations

from typing import Sequence

from . import validation as V
from .chat_messages import message_dict
from .chat_messages import template_kwargs as template_kwargs_check
from .chat_template import NO_TEMPLATE, ChatTemplate
from .domain import FailedPrecondition, InvalidArgument

MAX_ROLE_CHARS = 64


class Prompts:
    def __init__(self, tokenizer, limits: V.Limits, template: ChatTemplate | None = None,
                 template_error: str = ""):
        self.tok, self.lim = tokenizer, limits
        self.template, self.template_error = template, template_error

    def need_tokenizer(self, what: str) -> None:
        """Refuse what needs the tokenizer when the model has none (FAILED_PRECONDITION /
        HTTP 400)."""
        if self.tok is None:
            raise FailedPrecondition(f"{what} needs a tokenizer and this model has none (its "
                                     f"artifact has no tokenizer.json): send token ids")

    def text(self, text: str, name: str = "text", add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids exactly as transformers' ``AutoTokenizer(text)`` gives them: the
        tokenizer.json's post-processor adds what the model expects (Llama 2/3's and Gemma's
        BOS; none for Qwen or the BPEs trained here). transformers >= 5 reads no
        ``add_bos_token``/``add_eos_token`` from tokenizer_config.json once a tokenizer.json
        exists, so neither does this (docs/structured-outputs.md, "Tokenization")."""
        self.need_tokenizer("a text prompt")
        return self.tok.encode(V.check_text(name, text, self.lim),
                               add_special_tokens=add_special_tokens)

    def texts(self, texts: Sequence[str], limit: int, name=lambda i: f"texts[{i}]",
              add_special_tokens: bool = True) -> list[list[int]]:
        """Several texts (Score, Tokenize), each checked, ``limit`` characters in all."""
        self.need_tokenizer("text")
        checked = V.check_texts(texts, limit, self.lim, name)
        return self.tok.encode_batch(checked, add_special_tokens=add_special_tokens)

    def prediction(self, text: str | None, ids: Sequence[int] | None,
                   name: str = "prediction") -> tuple[int, ...]:
        """The tokens of what the output is expected to repeat (OpenAI's ``prediction``): a
        text (tokenized without special tokens) or ids, within the context's length."""
        if text is not None:
            self.need_tokenizer(f"{name} as text")
            out = self.tok.encode(V.check_text(name, text, self.lim), add_special_tokens=False)
            if len(out) > self.lim.max_context:
                raise InvalidArgument(f"{name} has {len(out)} tokens; the limit is the "
                                      f"context's {self.lim.max_context}", field=name)
            return tuple(out)
        return tuple(V.check_ids(name, ids or (), self.lim, max_len=self.lim.max_context))

    def ids(self, ids: Sequence[int], name: str = "token_ids") -> list[int]:
        return V.check_ids(name, ids, self.lim, max_len=self.lim.max_context)

    def check_messages(self, messages: Sequence) -> list[dict]:
        """(role, content) pairs or message dicts (``chat_messages.MESSAGE_KEYS``: assistant
        ``tool_calls``, ``tool`` results), checked and bounded."""
        c = self.lim.cfg
        if not messages:
            raise InvalidArgument("the chat has no messages (it needs at least 1)")
        if len(messages) > c.max_chat_messages:
            raise InvalidArgument(f"the chat has {len(messages)} messages; the limit is "
                                  f"{c.max_chat_messages}")
        total = 0
        out = []
        for i, m in enumerate(messages):
            if isinstance(m, dict):
                msg, size = message_dict(i, m)
            else:
                role, content = m
                if not isinstance(role, str) or not isinstance(content, str):
                    raise InvalidArgument(f"messages[{i}]: role and content must be strings")
                msg, size = {"role": role, "content": content}, len(content)
            role = msg["role"]
            if not isinstance(role, str) or not role or len(role) > MAX_ROLE_CHARS \
                    or not role.isprintable():
                raise InvalidArgument(f"messages[{i}].role must be 1 to {MAX_ROLE_CHARS} "
                                      "printable characters")
            V.check_unicode(f"messages[{i}].role", role)
            if isinstance(msg.get("content"), str):
                V.check_unicode(f"messages[{i}].content", msg["content"])
            total += len(role) + size
            if total > c.max_chat_chars:
                raise InvalidArgument(f"the chat's messages have over {c.max_chat_chars} "
                                      f"characters in all; the limit is {c.max_chat_chars}")
            out.append(msg)
        return out

    def render(self, messages: Sequence, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None,
               template_kwargs: dict | None = None) -> str:
        """The chat rendered with the model's template (the prompt text).
        ``continue_final_message``: the text ends with the last message's content (its end of
        turn cut off), so the model continues it (transformers' apply_chat_template rule).
        ``tools``: the request's tools as the template receives them (``Tool.raw``);
        ``template_kwargs``: ``chat_template_kwargs`` (checked here)."""
        kw = {"tools": tools, **template_kwargs_check(template_kwargs)}
        if self.template is None:
            raise FailedPrecondition(self.template_error or NO_TEMPLATE)
        msgs = self.check_messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidArgument("continue_final_message and add_generation_prompt cannot "
                                      "both be true")
            if not isinstance(msgs[-1].get("content"), str):
                raise InvalidArgument("continue_final_message: the final message has no content "
                                      "to continue")
            msgs[-1] = {**msgs[-1], "content": msgs[-1]["content"] + CONTINUE_TAG}
            return cut_at_tag(self.template.render(msgs, add_generation_prompt=False, **kw))
        return self.template.render(msgs, add_generation_prompt=add_generation_prompt, **kw)

    def chat(self, messages: Sequence, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             template_kwargs: dict | None = None) -> list[int]:
        # The template writes its own BOS: encoded as transformers' apply_chat_template
        # (tokenize=True) does, without the post-processor's (never a second BOS).
        text = self.render(messages, add_generation_prompt, continue_final_message, tools,
                           template_kwargs)
        return self.text(text, name="the rendered chat prompt", add_special_tokens=False)


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def cut_at_tag(rendered: str) -> str:
    """transformers' continue_final_message rule: the final message is rendered with a tag
    appended and the text is cut where the tag is (the whitespace before it dropped as well
    when the template trimmed the tag's own trailing space)."""
    at = rendered.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise InvalidArgument("continue_final_message: the final message does not appear in "
                              "the rendered chat (the template changes its content)")
    if rendered[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()

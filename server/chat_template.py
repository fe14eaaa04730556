"""The model's chat template: ``chat_template`` of the artifact's ``tokenizer_config.json``
(carried there from the Hugging Face directory by import-hf and export, and hashed in the
manifest like every artifact file), rendered exactly as transformers' ``apply_chat_template``
renders it: jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` tag, the globals
``raise_exception``, ``strftime_now``, ``dict`` and an underscore-refusing ``namespace``, a
``tojson`` filter that does not escape HTML, and the special tokens (``bos_token``,
``eos_token``, ...) as variables. The sandbox refuses attribute access to internals
(``__class__``, ``__globals__``...), mutating methods and file access; a template that tries is
answered FAILED_PRECONDITION, never run further. Torch-free, transformers-free.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvserve.artifact.manifest import TOKENIZER_CONFIG

from .domain import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

# the named special tokens transformers passes to templates (SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
MAX_TEMPLATE_FILE_BYTES = 4 << 20
_MAX_MESSAGE_IN_ERROR = 200

NO_TEMPLATE = ("this model has no chat template (no chat_template in its tokenizer_config.json); "
               "send a text or token_ids prompt instead")
UNSAFE = ("the model's chat template tried an operation the sandbox forbids; chat is refused "
          "for this model (fix its chat_template)")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses the tag to
    track assistant tokens; rendering is unchanged)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body) \
            .set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateDict:
    """``dict`` for templates without dict's class attributes (as transformers does)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes (as transformers does)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes ({name!r})")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


def _token_str(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def pick_template(value: Any) -> str | None:
    """``chat_template`` is a string, or a list of ``{name, template}`` (the ``default`` one is
    used, as transformers does without tools)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        got = named.get("default")
        return got if isinstance(got, str) else None
    return None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items()
                               if k in SPECIAL_TOKENS and isinstance(v, str)}
        self._compiled = environment().from_string(source)  # TemplateSyntaxError if broken

    @classmethod
    def from_tokenizer_config(cls, cfg: dict) -> "ChatTemplate | None":
        source = pick_template(cfg.get("chat_template"))
        if source is None:
            return None
        return cls(source, {k: _token_str(cfg.get(k)) for k in SPECIAL_TOKENS
                            if _token_str(cfg.get(k)) is not None})

    @classmethod
    def load(cls, artifact_dir: str | Path) -> "ChatTemplate | None":
        """The artifact's template, None when it has none. Raises ValueError when the file or
        the template is broken (the server then serves without chat and says why)."""
        path = Path(artifact_dir) / TOKENIZER_CONFIG
        if not path.is_file():
            return None
        if path.stat().st_size > MAX_TEMPLATE_FILE_BYTES:
            raise ValueError(f"{TOKENIZER_CONFIG} is over {MAX_TEMPLATE_FILE_BYTES} bytes")
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object")
            return cls.from_tokenizer_config(cfg)
        except (ValueError, UnicodeDecodeError, jinja2.TemplateSyntaxError) as e:
            raise ValueError(f"{TOKENIZER_CONFIG}: unusable chat template "
                             f"({type(e).__name__}: {str(e)[:_MAX_MESSAGE_IN_ERROR]})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **template_kwargs) -> str:
        """The prompt text for ``messages`` (plain dicts of strings). Raises InvalidArgument when
        the template refuses the messages (its own ``raise_exception`` or an error while
        rendering them) and FailedPrecondition when it tries to leave the sandbox."""
        # what transformers does to messages: copies of plain data, None-valued keys dropped
        msgs = [{str(k): v for k, v in m.items() if v is not None} for m in messages]
        try:
            # as transformers: the special tokens, then chat_template_kwargs over them
            return self._compiled.render(messages=msgs, tools=tools or None, documents=None,
                                         add_generation_prompt=bool(add_generation_prompt),
                                         **{**self.special_tokens, **template_kwargs})
        except jinja2.exceptions.SecurityError as e:
            log.warning("chat template refused by the sandbox: %s", e)
            raise FailedPrecondition(UNSAFE) from None
        except jinja2.exceptions.TemplateError as e:
            msg = " ".join(str(e).split())[:_MAX_MESSAGE_IN_ERROR]
            raise InvalidArgument(f"the chat template refused these messages: {msg}") from None
        except RecursionError:
            raise InvalidArgument("the chat template could not render these messages "
                                  "(recursion too deep)") from None
        except Exception as e:  # noqa: BLE001 - a template error on this input, not a crash
            raise InvalidArgument("the chat template could not render these messages "
                                  f"({type(e).__name__})") from None

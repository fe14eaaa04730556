"""Constrained decoding with llguidance: what a request asks for (``ConstraintSpec``), the
server's token table for it (``GuideTokenizer``, built once per server from the artifact's
``tokenizer.json``: no transformers, no torch) and one sequence's matcher (``Constraint``).

A step of a constrained row, in this order (the engine's side of the contract):

1. ``fill(bitmask_row)`` (or the batch helper in ``constraint_masks``) - the allowed tokens;
2. the masked logits are sampled (disallowed = -inf; greedy, sampled, penalties alike);
3. ``consume(token)`` - the chosen token fed back (raises ``ConstraintViolation`` if refused);
4. ``done`` - the grammar has stopped (it took an end token): finish the row.

``forced()`` lists the tokens the grammar forces next (the same whatever the model says),
without consuming them: the engine feeds them as the row's draft and keeps each one the plain
path's sampling picks (``server.fast_forward``), consuming it in step 3 as any other token.
The end tokens (``eos_ids``) are allowed exactly when the grammar accepts what is written.
"""
from __future__ import annotations

import json
import logging
import re
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import llguidance as llg
import llguidance.numpy as lln
import numpy as np

from .domain import InvalidArgument
from .validation import check_unicode

log = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SCHEMA_CHARS = 64 * 1024   # a JSON schema, serialized
MAX_REGEX_CHARS = 4096
MAX_GRAMMAR_CHARS = 64 * 1024  # a Lark grammar
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096        # one choice
MAX_CHOICES_CHARS = 64 * 1024  # all choices together
# JSON without free whitespace between tokens (", " and ": " separators): a weak or random
# model otherwise fills max_new_tokens with newlines inside a valid document (vLLM's
# --disable-any-whitespace). A schema's own "x-guidance" settings win.
JSON_DEFAULTS = {"whitespace_flexible": False}
MAX_ERROR_CHARS = 300          # llguidance's messages quote the grammar: the first line, bounded


# what a constraint with no first token typically is, by kind
_NO_WAY_OUT = {"json_schema": " (e.g. a schema that is only a $ref to itself)",
               "grammar": " (e.g. a rule that only refers to itself)",
               "regex": " (e.g. an empty character class)"}


class ConstraintViolation(RuntimeError):
    """A token the grammar refuses was fed to ``consume``: the engine sampled outside the mask
    (a server bug, never the caller's fault)."""


def _first_line(msg: str) -> str:
    """llguidance's message on one bounded line: its first line, plus the regex engine's
    ``error:`` line (the first line alone says only "regex parse error:")."""
    lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()] or ["invalid"]
    line = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    detail = next((ln for ln in lines[1:] if ln.startswith("error:")), "")
    if detail:
        line = f"{line} {detail[len('error:'):].strip()}"
    return line[:MAX_ERROR_CHARS]


@dataclass(frozen=True)
class ConstraintSpec:
    """What a request constrains its output to, checked on construction.

    kind: ``json_schema`` (value: the schema, a dict), ``json_object`` (value: None; any JSON
    object), ``regex`` (value: a Rust-regex pattern the whole output must match), ``choice``
    (value: a tuple of strings; the output is exactly one), ``grammar`` (value: a Lark grammar
    in llguidance's dialect). ``field`` names the request field in error messages
    (e.g. ``response_format.json_schema.schema``). Bad values raise ``InvalidArgument``.
    """
    kind: str
    value: Any = None
    field: str = "structured"
    grammar: str = dataclasses.field(default="", init=False, repr=False, compare=False)

    def __post_init__(self):
        try:
            grammar = _to_grammar(self.kind, self.value, self.field)
            is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar, None)
        except RecursionError:  # (a schema's JSON text or dict nesting past Python's stack)
            raise InvalidArgument(f"{self.field}: the schema nests too deeply") from None
        except (ValueError, TypeError) as e:  # llguidance refusing what the checks let by
            raise InvalidArgument(f"{self.field}: {_first_line(str(e))}") from None
        if is_error:
            raise InvalidArgument(f"{self.field}: {_first_line(msgs[0] if msgs else '')}")
        object.__setattr__(self, "grammar", grammar)

    # Constructors named after the kinds (the same checks).
    @classmethod
    def json_schema(cls, schema, field: str = "json_schema") -> "ConstraintSpec":
        return cls("json_schema", schema, field)

    @classmethod
    def json_object(cls, field: str = "json_object") -> "ConstraintSpec":
        return cls("json_object", None, field)

    @classmethod
    def regex(cls, pattern: str, field: str = "regex") -> "ConstraintSpec":
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, choices: Sequence[str], field: str = "choice") -> "ConstraintSpec":
        if isinstance(choices, list):
            choices = tuple(choices)
        return cls("choice", choices, field)

    @classmethod
    def lark(cls, grammar: str, field: str = "grammar") -> "ConstraintSpec":
        return cls("grammar", grammar, field)


def _to_grammar(kind: str, value, name: str) -> str:
    if kind == "json_schema":
        if isinstance(value, str):
            if len(value) > MAX_SCHEMA_CHARS:
                raise InvalidArgument(f"{name}: the schema has {len(value)} characters; the "
                                      f"limit is {MAX_SCHEMA_CHARS}")
            try:
                value = json.loads(value)
            except ValueError as e:
                raise InvalidArgument(f"{name}: the schema is not valid JSON ({e})") from None
        if not isinstance(value, (dict, bool)):
            raise InvalidArgument(f"{name} must be a JSON schema (an object)")
        if value is False:
            raise InvalidArgument(f"{name} is the schema false, which no output matches")
        if value is True:  # the schema true: any JSON value (llguidance takes objects only)
            value = {}
        text = check_unicode(name, json.dumps(value, ensure_ascii=False))
        if len(text) > MAX_SCHEMA_CHARS:
            raise InvalidArgument(f"{name}: the schema has {len(text)} characters; the limit "
                                  f"is {MAX_SCHEMA_CHARS}")
        return llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                      defaults=JSON_DEFAULTS)
    if kind == "regex":
        _check_str(name, value, MAX_REGEX_CHARS, "pattern")
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "grammar":
        _check_str(name, value, MAX_GRAMMAR_CHARS, "Lark grammar")
        return llg.LLMatcher.grammar_from_lark(value)
    if kind == "choice":
        return _choice_grammar(value, name)
    if kind == THOUGHT_FIRST:
        return _thought_first(*value)
    raise InvalidArgument(f"{name}: unknown constraint kind {kind!r}; the kinds are "
                          f"{', '.join(KINDS)}")


THOUGHT_FIRST = "thought_first"  # (internal: ``after_thought``)


def after_thought(spec: "ConstraintSpec", open_id: int, close_id: int,
                  opened: bool) -> "ConstraintSpec":
    """``spec`` applied after a thought (``server.reasoning``): an optional ``<think> ...
    </think>`` first (``opened``: the prompt opened it, so the reply starts inside it and
    must close it), free text inside (not the text ``</think>``), up to two newlines after
    it, then what ``spec`` constrains. The tags are the tokenizer's added tokens ``open_id``
    and ``close_id`` (``<think>`` and ``</think>``)."""
    return ConstraintSpec(THOUGHT_FIRST, (spec, int(open_id), int(close_id), bool(opened)),
                          spec.field)


def _thought_first(spec: "ConstraintSpec", open_id: int, close_id: int, opened: bool) -> str:
    # (llguidance gives a TopLevelGrammar's JSON for schemas and regexes, the Lark text itself
    # for Lark grammars: choices, tool calls, a request's own)
    g = spec.grammar
    top = json.loads(g) if g.lstrip().startswith("{") else {"grammars": [{"lark_grammar": g}]}
    grammars = top["grammars"]
    answer = grammars[0].setdefault("name", "kvserve_answer")
    # the thought: any text but the close tag's (which the reply splits at), then the tag
    # token and at most two newlines (Qwen3's), then the answer
    thought = f"THOUGHT <[{close_id}]> /(\\r?\\n){{0,2}}/"
    start = f"start: {thought} @{answer}" if opened else \
        f"start: thought? @{answer}\nthought: <[{open_id}]> {thought}"
    lark = start + "\nTHOUGHT: /(.|\\n)*/ & ~/(.|\\n)*<\\/think>(.|\\n)*/\n"
    return json.dumps({**top, "grammars": [{"lark_grammar": lark}, *grammars]})


def _check_str(name: str, value, limit: int, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} must be a non-empty string (a {what})")
    if len(value) > limit:
        raise InvalidArgument(f"{name}: the {what} has {len(value)} characters; the limit is "
                              f"{limit}")
    check_unicode(name, value)  # (a JSON string may carry a lone surrogate: llguidance
    # cannot take it)


def _choice_grammar(choices, name: str) -> str:
    if isinstance(choices, (str, bytes)) or not isinstance(choices, (list, tuple)):
        raise InvalidArgument(f"{name} must be a list of strings")
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise InvalidArgument(f"{name} has {len(choices)} choices; it needs 1 to {MAX_CHOICES}")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise InvalidArgument(f"{name}[{i}] must be a non-empty string")
        check_unicode(f"{name}[{i}]", c)
        if len(c) > MAX_CHOICE_CHARS:
            raise InvalidArgument(f"{name}[{i}] has {len(c)} characters; the limit is "
                                  f"{MAX_CHOICE_CHARS}")
    total = sum(len(c) for c in choices)
    if total > MAX_CHOICES_CHARS:
        raise InvalidArgument(f"{name} has {total} characters in all; the limit is "
                              f"{MAX_CHOICES_CHARS}")
    # Lark string literals take JSON's escapes: json.dumps quotes any text exactly.
    lits = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return llg.LLMatcher.grammar_from_lark(f"start: {lits}")


class GuideTokenizer:
    """llguidance's view of the served tokenizer: every token's bytes, for the masks.

    Built once per server (``build_s`` says what it cost: 1.6-3.6 s for Qwen3's 151k
    vocabulary on a loaded 2-core machine, 0.02-0.3 s for 4k-32k byte-level BPEs).
    ``vocab_size`` is the model's (the logits' width; tokens past the tokenizer's are never
    allowed); ``eos_ids`` are the tokens that end a generation (allowed once the grammar
    accepts).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]):
        eos = [int(i) for i in eos_ids]
        if not eos:
            raise ValueError("a constrained generation needs at least one end token (eos_ids)")
        t0 = time.perf_counter()
        self.ll = llg.LLTokenizer(tokenizer_json, n_vocab=int(vocab_size), eos_token=eos)
        self.build_s = time.perf_counter() - t0
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(eos)

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int,
                  eos_ids: Sequence[int]) -> "GuideTokenizer":
        return cls(Path(path).read_text(encoding="utf-8"), vocab_size, eos_ids)

    @property
    def mask_words(self) -> int:
        """int32 words per bitmask row."""
        return lln.get_bitmask_shape(1, self.vocab_size)[1]

    def constraint(self, spec: ConstraintSpec) -> "Constraint":
        return Constraint(self, spec)


class Constraint:
    """One sequence's matcher. Not thread-safe: one step at a time (the batch helper in
    ``constraint_masks`` may compute the masks of many in parallel)."""

    def __init__(self, guide: GuideTokenizer, spec: ConstraintSpec):
        self.guide, self.spec = guide, spec
        self.matcher = llg.LLMatcher(guide.ll, spec.grammar, log_level=0)
        if self.error is not None:
            raise InvalidArgument(f"{spec.field}: {self.error}", field=spec.field)
        self._mask = lln.allocate_token_bitmask(1, guide.vocab_size)
        # a grammar that admits no first token fails only when its first mask is computed
        # (a JSON schema that is nothing but a $ref to itself: the reply was "", finished by
        # the end token its error state allows)
        self.fill(self._mask)
        if self.error is not None:
            log.debug("%s: no first token (%s)", spec.field, self.error)
            raise InvalidArgument(f"{spec.field}: no output satisfies this {spec.kind} "
                                  f"constraint: it allows no first token"
                                  f"{_NO_WAY_OUT.get(spec.kind, '')}", field=spec.field)

    def fresh(self) -> "Constraint":
        """A new matcher of the same grammar, at its start."""
        return Constraint(self.guide, self.spec)

    def fill(self, bitmask_row: np.ndarray) -> None:
        """Write the allowed-token bitmask (int32 words, bit i of word w = token 32*w+i)."""
        row = bitmask_row.reshape(1, -1) if bitmask_row.ndim == 1 else bitmask_row
        lln.fill_next_token_bitmask(self.matcher, row, 0)

    def apply(self, logits_row: np.ndarray) -> None:
        """Disallowed tokens' logits -> -inf, in place (one row, float32/float16; a strided
        view of a batch's logits is fine)."""
        self.fill(self._mask)
        apply_bitmask(logits_row, self._mask[0])

    def allowed(self) -> np.ndarray:
        """The allowed tokens as a bool vector of the model's vocabulary (for tests, logprobs)."""
        self.fill(self._mask)
        return unpack_bitmask(self._mask, self.guide.vocab_size)[0]

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise ConstraintViolation(f"token {int(token)} is not allowed by the {self.spec.kind}"
                                      f" constraint: {_first_line(self.matcher.get_error())}")

    def consume_tokens(self, tokens: Sequence[int]) -> None:
        if not self.matcher.consume_tokens([int(t) for t in tokens]):
            raise ConstraintViolation(f"tokens {list(tokens)[:8]} are not allowed by the "
                                      f"{self.spec.kind} constraint: "
                                      f"{_first_line(self.matcher.get_error())}")

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (may be empty); not yet consumed."""
        return list(self.matcher.compute_ff_tokens())

    @property
    def error(self) -> str | None:
        """Why the matcher cannot go on (llguidance's reason, one bounded line), else None: it
        found no token to allow after what is written (a grammar with no way out from here: a
        schema property whose ``$ref`` leads only back to itself), or passed its limits; its
        mask then allows only an end token."""
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else None

    @property
    def done(self) -> bool:
        """The grammar has stopped: it consumed an end token, or nothing more can follow."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """What is written so far is a complete match (an end token is allowed now)."""
        return self.matcher.is_accepting()


def unpack_bitmask(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """([rows,] words) int32 -> ([rows,] vocab_size) bool."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def apply_bitmask(logits: np.ndarray, mask: np.ndarray) -> None:
    """logits ([rows,] vocab) in place: tokens whose bit is 0 -> -inf. np.unpackbits + copyto,
    per row at Qwen3's 151,936 on a loaded 2-core machine: 1.3 ms with a random half-open mask
    (llguidance.numpy's repeat/tile kernel: 5.8 ms), 0.2-0.6 ms when few or most tokens are
    allowed (0.3-0.8 ms); 8-25 us at 4k-32k."""
    if logits.ndim != mask.ndim:
        raise ValueError(f"logits {logits.shape} and mask {mask.shape}: both rows or both batches")
    allowed = unpack_bitmask(mask, logits.shape[-1])
    np.copyto(logits, -np.inf, where=~allowed)  # in place, strided views included

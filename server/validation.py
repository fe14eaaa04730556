"""Every field a caller sends, bounded. Errors name the field and the limit (INVALID_ARGUMENT).

Input here is plain Python values (the servicer unpacks protobuf); output is domain types.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


from .config import ServerConfig
from .domain import InvalidArgument, OutputParams, ScoreRequest, StopParams, Unimplemented

MAX_REQUEST_ID_CHARS = 128
MAX_SEED = (1 << 64) - 1


# the per-call totals of the text and id lists (also used to size the receive limit)
def score_chars(cfg) -> int:
    """Characters of all Score texts together (each text: max_prompt_chars)."""
    return 4 * cfg.max_prompt_chars


def tokenize_chars(cfg) -> int:
    """Characters of all Tokenize texts together (each text: max_prompt_chars)."""
    return 4 * cfg.max_prompt_chars


def detokenize_ids(cfg) -> int:
    """Token ids of all Detokenize sequences together (each sequence: max_score_tokens)."""
    return 4 * cfg.max_score_tokens


@dataclass(frozen=True)
class Limits:
    """The bounds of one server on one model (ModelInfo reports them)."""
    vocab_size: int
    n_layers: int
    n_heads: int
    max_context: int
    cfg: ServerConfig

    @classmethod
    def make(cls, cfg: ServerConfig, vocab_size: int, n_layers: int, n_heads: int,
             max_seq_len: int) -> "Limits":
        ctx = min(cfg.max_context, max_seq_len) if cfg.max_context else max_seq_len
        return cls(vocab_size, n_layers, n_heads, ctx, cfg)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgument(msg)


def _finite(name: str, v: float, bounds: str) -> float:
    """NaN and infinities are refused with the same message as an out-of-range value."""
    _need(isinstance(v, (int, float)) and math.isfinite(v),
          f"{name} must be a finite number in {bounds}")
    return float(v)


def check_request_id(rid: str) -> str:
    _need(len(rid) <= MAX_REQUEST_ID_CHARS and rid.isprintable(),
          f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters")
    return rid


def is_utf8(text: str) -> bool:
    """False for a str UTF-8 cannot encode: one with a lone surrogate."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_unicode(name: str, text: str) -> str:
    """``text`` is a str that UTF-8 can encode. gRPC strings always are (protobuf checks them);
    a JSON string can carry a lone surrogate (``"\\ud800"``), which the tokenizer refuses with
    a TypeError: it is refused here, naming the field."""
    _need(isinstance(text, str), f"{name} must be a string")
    if not is_utf8(text):
        e = next(i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff")
        raise InvalidArgument(f"{name} is not valid Unicode (a lone surrogate {text[e]!r} at "
                              f"character {e}; UTF-8 text only)")
    return text


def check_text(name: str, text: str, lim: Limits) -> str:
    """Every text bound for the tokenizer goes through here: its length and its encoding."""
    _need(len(text) <= lim.cfg.max_prompt_chars,
          f"{name} has {len(text)} characters; the limit is {lim.cfg.max_prompt_chars}")
    return check_unicode(name, text)


def check_ids(name: str, ids: Sequence[int], lim: Limits, max_len: int | None = None) -> list[int]:
    """``ids`` may be a protobuf repeated field: its length is checked before any element
    becomes a Python int."""
    if max_len is not None:
        _need(len(ids) <= max_len, f"{name} has {len(ids)} tokens; the limit is {max_len}")
    ids = [int(i) for i in ids]
    bad = next((i for i in ids if not 0 <= i < lim.vocab_size), None)
    _need(bad is None, f"{name} contains token id {bad}, outside the vocabulary "
                       f"[0, {lim.vocab_size})")
    return ids


def score_lengths(lengths: Sequence[int], lim: Limits) -> None:
    """The Score bounds that need only each sequence's length (checked before the sequences
    are materialized)."""
    total = 0
    for i, n in enumerate(lengths):
        _need(n >= 1, f"sequence {i} is empty (it needs at least 1 token)")
        _need(n <= lim.max_context,
              f"sequence {i} has {n} tokens; the context limit is {lim.max_context}")
        total += n
    _need(total <= lim.cfg.max_score_tokens,
          f"the sequences have {total} tokens in all; the limit is {lim.cfg.max_score_tokens} "
          f"per call")


def check_texts(texts: Sequence[str], limit: int, lim: Limits, name=lambda i: f"texts[{i}]",
                what: str = "") -> list[str]:
    """Each text within max_prompt_chars and all of them within ``limit`` characters, before
    any of them is tokenized. ``texts`` may be a protobuf repeated field: each text becomes a
    Python str only for its length check (none is kept until all have passed)."""
    total = 0
    for i, t in enumerate(texts):
        check_text(name(i), t, lim)
        total += len(t)
    _need(total <= limit, f"{what}{total} characters in all; the limit is {limit}")
    return list(texts)


def stop_params(*, prompt_len: int, max_new_tokens: int, min_new_tokens: int,
                stop: Sequence[str], stop_token_ids: Sequence[int], ignore_eos: bool,
                lim: Limits) -> StopParams:
    c = lim.cfg
    _need(prompt_len >= 1, "the prompt is empty (it needs at least 1 token)")
    _need(prompt_len < lim.max_context,
          f"the prompt has {prompt_len} tokens; the context limit is {lim.max_context} "
          f"(prompt + new tokens)")
    n = max_new_tokens or min(c.default_max_new_tokens, lim.max_context - prompt_len)
    _need(1 <= n <= c.max_new_tokens,
          f"stopping.max_new_tokens must be in [1, {c.max_new_tokens}]")
    _need(prompt_len + n <= lim.max_context,
          f"prompt ({prompt_len} tokens) + stopping.max_new_tokens ({n}) exceeds the context "
          f"limit {lim.max_context}")
    _need(0 <= min_new_tokens <= n, "stopping.min_new_tokens must be in [0, max_new_tokens]")
    _need(len(stop) <= c.max_stop_strings,
          f"stopping.stop has {len(stop)} strings; the limit is {c.max_stop_strings}")
    for i, s in enumerate(stop):
        _need(0 < len(s) <= c.max_stop_string_chars,
              f"each stopping.stop string must have 1 to {c.max_stop_string_chars} characters")
        check_unicode(f"stopping.stop[{i}]", s)
    _need(len(stop_token_ids) <= c.max_stop_token_ids,
          f"stopping.stop_token_ids has {len(stop_token_ids)} ids; the limit is "
          f"{c.max_stop_token_ids}")
    ids = check_ids("stopping.stop_token_ids", stop_token_ids, lim)
    return StopParams(max_new_tokens=n, min_new_tokens=int(min_new_tokens),
                      stop=tuple(dict.fromkeys(stop)), stop_token_ids=tuple(dict.fromkeys(ids)),
                      ignore_eos=bool(ignore_eos))


def output_params(*, prompt_len: int, max_new_tokens: int, logprobs: bool, top_logprobs: int,
                  return_logits: bool, attention_layers: Sequence[int],
                  attention_heads: Sequence[int], attention_available: bool,
                  lim: Limits) -> OutputParams:
    c = lim.cfg
    _need(0 <= top_logprobs <= c.max_top_logprobs,
          f"response.top_logprobs must be in [0, {c.max_top_logprobs}]")
    _need(top_logprobs <= lim.vocab_size, f"response.top_logprobs must be <= {lim.vocab_size}")
    if return_logits:
        floats = max_new_tokens * lim.vocab_size
        _need(floats <= c.max_logits_floats,
              f"response.return_logits: max_new_tokens x vocab = {floats} floats; the limit is "
              f"{c.max_logits_floats} (lower max_new_tokens)")
    layers = tuple(int(x) for x in attention_layers)
    heads = tuple(int(x) for x in attention_heads)
    if heads and not layers:
        raise InvalidArgument("response.attention.heads needs response.attention.layers")
    if layers:
        if not attention_available:
            raise Unimplemented("attention diagnostics are not available on this server "
                                "(the artifact has no attention graphs)")
        _need(len(set(layers)) == len(layers) and all(0 <= x < lim.n_layers for x in layers),
              f"response.attention.layers must be unique layer indices in [0, {lim.n_layers})")
        _need(len(set(heads)) == len(heads) and all(0 <= x < lim.n_heads for x in heads),
              f"response.attention.heads must be unique head indices in [0, {lim.n_heads})")
        heads = heads or tuple(range(lim.n_heads))
        total = prompt_len + max_new_tokens
        # the row of step k has prompt_len + k floats: sum over k < max_new_tokens
        floats = len(layers) * len(heads) * max_new_tokens * (prompt_len + (max_new_tokens - 1) / 2)
        _need(floats <= c.max_attention_floats,
              f"response.attention: {len(layers)} layers x {len(heads)} heads over {total} "
              f"positions is {int(floats)} floats; the limit is {c.max_attention_floats}")
    return OutputParams(logprobs=bool(logprobs), top_logprobs=int(top_logprobs),
                        return_logits=bool(return_logits), attention_layers=layers,
                        attention_heads=heads)


def score_request(sequences: list[list[int]], top_logprobs: int, request_id: str,
                  lim: Limits) -> ScoreRequest:
    c = lim.cfg
    _need(len(sequences) >= 1, "nothing to score: give texts or token_ids (1 to "
                               f"{c.max_score_sequences} sequences)")
    _need(len(sequences) <= c.max_score_sequences,
          f"{len(sequences)} sequences; the limit is {c.max_score_sequences} per call")
    score_lengths([len(s) for s in sequences], lim)
    for i, s in enumerate(sequences):
        check_ids(f"sequence {i}", s, lim)
    _need(0 <= top_logprobs <= c.max_top_logprobs,
          f"top_logprobs must be in [0, {c.max_top_logprobs}]")
    return ScoreRequest([list(map(int, s)) for s in sequences], int(top_logprobs),
                        check_request_id(request_id))

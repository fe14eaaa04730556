"""One request mapping for gRPC and HTTP: every sampling field written once, with its default
and bounds, read from either wire format and checked by the same code.

``SAMPLING_FIELDS`` is the table. A field's name is the ``SamplingParams`` attribute, the
``SamplingOptions`` field in ``protos/kvserve/v1/inference.proto`` and the key of the OpenAI
request body alike. ``from_grpc`` and ``from_json`` read the raw values (the wire's own type
rules: a JSON string where a number belongs is refused here); ``sampling_params`` checks every
value against its bounds, with one message format, naming the field as the caller wrote it
(``sampling.top_p`` over gRPC, ``'top_p'`` over HTTP).

A new sampling parameter touches: ``model/sampling.py`` (the field and what it does), this
table, the proto, and the Python client's request builder.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from kvserve.model.sampling import GREEDY_BELOW_TEMPERATURE, SamplingParams

from .domain import InvalidArgument
from .validation import MAX_SEED, Limits

_SAME = object()


@dataclass(frozen=True)
class Field:
    name: str
    kind: type  # float or int
    default: Any
    bounds: Callable[[Limits], tuple[float, float]]
    lo_open: bool = False  # the lower bound itself is refused
    optional: bool = False  # proto3 ``optional``: unset means ``default`` (else 0 is a value)
    http_default: Any = _SAME  # the OpenAI API's default, where it differs
    note: str = ""  # after the range in messages

    def range_text(self, lim: Limits) -> str:
        lo, hi = self.bounds(lim)
        return f"{'(' if self.lo_open else '['}{lo}, {hi}]"


def _penalty(lim: Limits) -> tuple[float, float]:
    return -lim.cfg.max_abs_penalty, lim.cfg.max_abs_penalty


SAMPLING_FIELDS: tuple[Field, ...] = (
    Field("temperature", float, 0.0, lambda lim: (0, lim.cfg.max_temperature),
          http_default=1.0, note=" (0 = greedy)"),
    Field("top_k", int, 0, lambda lim: (0, lim.vocab_size), note=" (0 = off)"),
    Field("top_p", float, 1.0, lambda lim: (0, 1), lo_open=True, optional=True),
    Field("min_p", float, 0.0, lambda lim: (0, 1)),
    # [1/limit, limit]: a penalty near 0 divides logits into inf (NaN probabilities)
    Field("repetition_penalty", float, 1.0,
          lambda lim: (round(1.0 / lim.cfg.max_repetition_penalty, 6),
                       lim.cfg.max_repetition_penalty), optional=True, note=" (1 = off)"),
    Field("presence_penalty", float, 0.0, _penalty),
    Field("frequency_penalty", float, 0.0, _penalty),
    Field("seed", int, None, lambda lim: (0, MAX_SEED), optional=True),
)
FIELD_NAMES = frozenset(f.name for f in SAMPLING_FIELDS)


def from_grpc(msg) -> dict[str, Any]:
    """Raw values of a ``SamplingOptions`` message (proto3: unset scalars read as 0, which is
    each non-optional field's default or a value)."""
    return {f.name: getattr(msg, f.name) if not f.optional or msg.HasField(f.name)
            else f.default for f in SAMPLING_FIELDS}


def from_json(body: dict) -> dict[str, Any]:
    """Raw values of an OpenAI request body, type-checked (``InvalidArgument`` names the key)."""
    out = {}
    for f in SAMPLING_FIELDS:
        v = body.get(f.name)
        if v is None:
            out[f.name] = f.default if f.http_default is _SAME else f.http_default
            continue
        ok = isinstance(v, int) if f.kind is int else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok:
            what = "an integer" if f.kind is int else "a number"
            raise InvalidArgument(f"'{f.name}' must be {what}", field=f.name)
        out[f.name] = v
    return out


def _check(f: Field, v: Any, lim: Limits, label: str) -> Any:
    if v is None:  # (only the seed has no value)
        return None
    lo, hi = f.bounds(lim)
    if isinstance(v, float) and not math.isfinite(v):
        raise InvalidArgument(f"{label} must be a finite number in {f.range_text(lim)}",
                              field=f.name)
    # (a float32 on the wire may round a bound such as 1/100 just below it)
    lo_ok = v > lo if f.lo_open else v >= lo - abs(lo) * 1e-6
    if not lo_ok or v > hi:
        shown = f"{v:g}" if isinstance(v, float) else str(v)
        raise InvalidArgument(f"{label} is {shown}; it must be in {f.range_text(lim)}{f.note}",
                              field=f.name)
    return f.kind(v)


def sampling_params(values: dict[str, Any], lim: Limits, prefix: str = "sampling.",
                    quote: str = "") -> SamplingParams:
    """``SamplingParams`` from raw values (``from_grpc`` / ``from_json``), each within its
    bounds. Labels in messages: ``{quote}{prefix}{name}{quote}``."""
    kw = {f.name: _check(f, values[f.name], lim, f"{quote}{prefix}{f.name}{quote}")
          for f in SAMPLING_FIELDS}
    if kw["temperature"] < GREEDY_BELOW_TEMPERATURE:  # greedy (SamplingParams.greedy): 0
        kw["temperature"] = 0.0
    return SamplingParams(**kw)

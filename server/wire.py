"""Request bytes -> messages, under the server's control.

Every method is served with an identity request deserializer: gRPC hands the handler the raw
bytes, and ``WireInterceptor`` (the innermost interceptor, after auth) turns them into the
request message itself, in three steps, each before the next costs anything:

1. size: the bytes are refused when they exceed what the largest valid request of that method
   can take (derived from the caps: ``request_limits``);
2. counts: one pass over the wire format counts the elements of every repeated field (a packed
   id list is counted by its bytes, without decoding it) and the characters of the text fields
   (by their UTF-8 lead bytes), and refuses a count far over its cap, so that the parser never
   builds millions of elements, or copies megabytes of text, out of a request that is refused
   anyway;
3. parse: the protobuf parser; bytes that are not the request message (invalid UTF-8 in a
   string field, truncated, groups, random bytes) are answered INVALID_ARGUMENT
   ``malformed <Method> request``, logged as one WARNING line without a traceback and counted
   in ``kvserve_malformed_requests_total``.

gRPC's own ``grpc.max_receive_message_length`` is the largest of the per-method limits
(``receive_limit``). The servicer then checks each cap exactly (lengths of repeated fields and
strings before it converts or tokenizes anything).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import DecodeError

from kvserve.v1 import inference_pb2 as pb

from .constraints import (MAX_CHOICES, MAX_CHOICES_CHARS, MAX_GRAMMAR_CHARS,
                          MAX_SCHEMA_CHARS)
from .servicer import MAX_TOKENIZE_TEXTS
from .validation import MAX_REQUEST_ID_CHARS, detokenize_ids, score_chars, tokenize_chars

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"]
UTF8_MAX = 4  # bytes per character
ID_MAX = 6  # bytes per uint32 element on the wire (unpacked: a tag byte and a 5-byte varint)
ENTRY = 8  # tag and length prefix of one string / sub-message entry
SLACK = 4096  # the scalar fields (sampling, flags, ...) and room for unknown fields
OTHER_SERVICES_LIMIT = 64 << 10  # health and reflection requests are a few bytes
MAX_REQUEST_ID_BYTES = MAX_REQUEST_ID_CHARS * UTF8_MAX
MAX_DEPTH = 8  # nesting of the request messages is 3 at most


def guard(cap: int) -> int:
    """The count at which step 2 refuses: well over the cap (the servicer answers the exact
    cap with its own message), but bounded by it."""
    return 2 * cap + 16


@dataclass(frozen=True)
class MethodLimit:
    max_bytes: int
    caps: dict[str, tuple[int, str]] = field(default_factory=dict)  # path -> (cap, what)


def request_limits(cfg, lim) -> dict[str, MethodLimit]:
    """Per method (``/kvserve.v1.Inference/Generate`` ...): the largest valid request in bytes
    and the caps of its repeated fields. ``cfg`` is the ServerConfig, ``lim`` the Limits."""
    stops = cfg.max_stop_strings * (cfg.max_stop_string_chars * UTF8_MAX + ENTRY)
    resumed = min(cfg.max_new_tokens, lim.max_context)  # Resume.token_ids
    # GenerateRequest.structured: one schema, regex, grammar or list of choices
    structured = max(MAX_SCHEMA_CHARS, MAX_GRAMMAR_CHARS, MAX_CHOICES_CHARS) * UTF8_MAX \
        + MAX_CHOICES * ENTRY
    text_or_ids = max(cfg.max_prompt_chars * UTF8_MAX, lim.max_context * ID_MAX)
    generate = (2 * text_or_ids + stops  # (the prompt and a prediction)
                + structured
                + (cfg.max_stop_token_ids + lim.n_layers + lim.n_heads + resumed) * ID_MAX)
    score = max(score_chars(cfg) * UTF8_MAX, cfg.max_score_tokens * ID_MAX) \
        + cfg.max_score_sequences * ENTRY
    tokenize = tokenize_chars(cfg) * UTF8_MAX + MAX_TOKENIZE_TEXTS * ENTRY
    detokenize = detokenize_ids(cfg) * ID_MAX + MAX_TOKENIZE_TEXTS * ENTRY
    base = SLACK + MAX_REQUEST_ID_BYTES
    out = {
        "Generate": MethodLimit(base + generate, {
            "text.chars": (cfg.max_prompt_chars, "characters"),
            "token_ids.ids": (lim.max_context, "prompt tokens"),
            "stopping.stop": (cfg.max_stop_strings, "stop strings"),
            "stopping.stop_token_ids": (cfg.max_stop_token_ids, "stop token ids"),
            "response.attention.layers": (lim.n_layers, "attention layers"),
            "response.attention.heads": (lim.n_heads, "attention heads"),
            "resume.token_ids": (resumed, "resumed tokens"),
            "prediction.text.chars": (cfg.max_prompt_chars, "characters"),
            "prediction.token_ids.ids": (lim.max_context, "prediction tokens"),
            "structured.choice.choices": (MAX_CHOICES, "choices")}),
        "Score": MethodLimit(base + score, {
            "texts": (cfg.max_score_sequences, "sequences"),
            "texts.chars": (score_chars(cfg), "characters in all"),
            "token_ids": (cfg.max_score_sequences, "sequences"),
            "token_ids.ids": (cfg.max_score_tokens, "tokens in all")}),
        "Tokenize": MethodLimit(base + tokenize, {
            "texts": (MAX_TOKENIZE_TEXTS, "texts"),
            "texts.chars": (tokenize_chars(cfg), "characters in all")}),
        "Detokenize": MethodLimit(base + detokenize, {
            "token_ids": (MAX_TOKENIZE_TEXTS, "sequences"),
            "token_ids.ids": (detokenize_ids(cfg), "tokens in all")}),
        "ModelInfo": MethodLimit(base),
    }
    return {f"/{SERVICE.full_name}/{k}": v for k, v in out.items()}


def receive_limit(limits: dict[str, MethodLimit]) -> int:
    """grpc.max_receive_message_length: the largest valid request of any method."""
    return max([OTHER_SERVICES_LIMIT, *(m.max_bytes for m in limits.values())])


# --- step 2: counting repeated elements on the wire ------------------------------------------
class Malformed(Exception):
    """Not a protobuf message of the expected shape."""


class OverLimit(Exception):
    def __init__(self, path: str, count: int):
        super().__init__(path)
        self.path, self.count = path, count


_HIGH = bytes(range(0x80, 0x100))  # bytes of a varint that one more byte follows
_CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 bytes that do not start a character
_CHUNK = 1 << 16
_VARINTS = {FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_SINT32,
            FD.TYPE_SINT64, FD.TYPE_BOOL, FD.TYPE_ENUM}
_FIXED = {FD.TYPE_FIXED32: 4, FD.TYPE_SFIXED32: 4, FD.TYPE_FLOAT: 4, FD.TYPE_FIXED64: 8,
          FD.TYPE_SFIXED64: 8, FD.TYPE_DOUBLE: 8}


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise Malformed("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise Malformed("varint longer than 10 bytes")


def count_repeated(buf: bytes, desc, caps: dict[str, tuple[int, str]]) -> dict[str, int]:
    """Walk the wire format of a ``desc`` message, counting the elements of every repeated
    field named in ``caps`` (by dotted path, summed over all occurrences). Raises Malformed
    for bytes that cannot be a message (truncation, bad varints, groups, field number 0) and
    OverLimit as soon as a count passes ``guard(cap)``. Nothing is decoded or copied but the
    packed lists it counts."""
    counts: dict[str, int] = {}
    _walk(buf, 0, len(buf), desc, "", caps, counts, 0)
    return counts


def _count_units(buf: bytes, start: int, end: int, stop_after: int, skip: bytes) -> int:
    """Bytes of buf[start:end] not in ``skip``, a chunk at a time (no copy of the field),
    stopping once past ``stop_after`` (negative: uncapped, not counted). With ``skip`` the
    bytes with the continuation bit, that is the elements of a packed varint list; with the
    UTF-8 continuation bytes, the characters of a string."""
    n = 0
    if stop_after < 0:
        return n
    for s in range(start, end, _CHUNK):
        n += len(buf[s:min(end, s + _CHUNK)].translate(None, skip))
        if n > stop_after:
            break
    return n


def _walk(buf, pos, end, desc, prefix, caps, counts, depth) -> None:
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise Malformed("field number 0")
        fd = desc.fields_by_number.get(number) if desc is not None else None
        n = 1
        if wire == 0:
            _, pos = _varint(buf, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            start, pos = pos, pos + length
            if pos > end:
                raise Malformed("truncated field")
            if fd is not None and fd.type == FD.TYPE_MESSAGE:
                if depth >= MAX_DEPTH:
                    raise Malformed("nested too deeply")
                _walk(buf, start, pos, fd.message_type, prefix + fd.name + ".", caps, counts,
                      depth + 1)
            elif fd is not None and fd.is_repeated and fd.type in _VARINTS:
                path = prefix + fd.name
                room = guard(caps[path][0]) - counts.get(path, 0) if path in caps else -1
                n = _count_units(buf, start, pos, room, _HIGH)
            elif fd is not None and fd.is_repeated and fd.type in _FIXED:
                n = length // _FIXED[fd.type]
            elif fd is not None and fd.type == FD.TYPE_STRING:
                _add(prefix + fd.name + ".chars", caps, counts,
                     lambda room: _count_units(buf, start, pos, room, _CONTINUATION))
        else:  # 3/4: groups (not in proto3 messages), 6/7: invalid
            raise Malformed(f"wire type {wire}")
        if pos > end:
            raise Malformed("truncated field")
        if fd is not None and fd.is_repeated:
            _add(prefix + fd.name, caps, counts, lambda room: n)


def _add(path: str, caps, counts, count) -> None:
    """counts[path] += count(room left under the guard); OverLimit past the guard."""
    if path not in caps:
        return
    c = counts[path] = counts.get(path, 0) + count(guard(caps[path][0]) - counts.get(path, 0))
    if c > guard(caps[path][0]):
        raise OverLimit(path, c)


# --- the interceptor -----------------------------------------------------------------------------
def _internal(method: str, context) -> None:
    """An exception escaping a handler without a status set (``abort`` sets one): a bug. It
    is logged here and the caller gets INTERNAL without its text (gRPC itself would answer
    UNKNOWN with the exception's message)."""
    if context.code() is not None:
        return
    log.exception("%s failed", method)
    context.abort(grpc.StatusCode.INTERNAL, f"{method.rsplit('/', 1)[-1]} failed (internal "
                                            f"error)")  # (raises: gRPC logs nothing more)


class WireInterceptor(grpc.ServerInterceptor):
    """Serves every method with raw bytes in and parses them itself (see the module doc).
    ``on_malformed(rpc)`` and ``on_refused(rpc)`` are metric hooks."""

    def __init__(self, limits: dict[str, MethodLimit], on_malformed=None, on_refused=None):
        self.limits = limits
        self.on_malformed = on_malformed or (lambda rpc: None)
        self.on_refused = on_refused or (lambda rpc: None)
        self._descs = {f"/{SERVICE.full_name}/{m.name}": m.input_type for m in SERVICE.methods}
        self._cache: dict[str, grpc.RpcMethodHandler | None] = {}

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method in self._cache:
            return self._cache[method]
        handler = continuation(handler_call_details)
        wrapped = None if handler is None else self._wrap(method, handler)
        if handler is not None and method in self._descs:  # one fixed handler per method
            self._cache[method] = wrapped
        return wrapped

    def _wrap(self, method: str, h: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        parse = self._parser(method, h.request_deserializer)
        kw = dict(request_deserializer=None, response_serializer=h.response_serializer)
        if h.request_streaming:
            inner = h.stream_stream or h.stream_unary

            def streaming(it, context):
                return inner((parse(raw, context) for raw in it), context)

            make = grpc.stream_stream_rpc_method_handler if h.response_streaming \
                else grpc.stream_unary_rpc_method_handler
            return make(streaming, **kw)
        if h.response_streaming:
            inner_us = h.unary_stream

            def unary_stream(raw, context):
                try:
                    yield from inner_us(parse(raw, context), context)
                except Exception:
                    _internal(method, context)
                    raise

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        inner_uu = h.unary_unary

        def unary_unary(raw, context):
            try:
                return inner_uu(parse(raw, context), context)
            except Exception:
                _internal(method, context)
                raise

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)

    def _parser(self, method: str, deserialize):
        rpc = method.rsplit("/", 1)[-1]
        limit = self.limits.get(method)
        max_bytes = limit.max_bytes if limit else OTHER_SERVICES_LIMIT
        desc = self._descs.get(method)

        def parse(raw, context):
            if deserialize is None:
                return raw
            if len(raw) > max_bytes:
                self.on_refused(rpc)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{rpc} request of {len(raw)} bytes; this server accepts at most "
                              f"{max_bytes} (derived from its limits)")
            try:
                if limit is not None and limit.caps:
                    count_repeated(raw, desc, limit.caps)
                return deserialize(raw)
            except OverLimit as e:
                cap, what = limit.caps[e.path]
                self.on_refused(rpc)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{rpc} request has too many {what} ({e.path}); the limit is "
                              f"{cap} (refused while reading, at {e.count})")
            except (Malformed, DecodeError, UnicodeDecodeError, RecursionError,
                    ValueError) as e:
                self.on_malformed(rpc)
                log.warning("malformed %s request (%d bytes) from %s: %s", rpc, len(raw),
                            context.peer(), _reason(e))
                full = desc.full_name if desc is not None else "request"
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"malformed {rpc} request: the bytes are not a valid {full} "
                              f"message (truncated, not protobuf, or a string field that is "
                              f"not UTF-8)")

        return parse


def _reason(e: Exception) -> str:
    text = str(e).splitlines()[0][:120] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__

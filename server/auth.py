"""Bearer-token authentication as a server interceptor (``authorization: Bearer <token>``).

The health service is exempt so that orchestrators can probe without the secret.
"""
from __future__ import annotations

import hmac
import logging

import grpc

log = logging.getLogger(__name__)

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def abort(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def abort_stream(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (makes this a generator for streaming handlers)

    # the body is never parsed for a refused call: bytes in (no deserializer), nothing read
    kw = dict(request_deserializer=None, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(lambda it, c: abort_stream(None, c), **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(lambda it, c: abort(None, c), **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(abort, **kw)


def bearer_ok(got: bytes, token: bytes) -> bool:
    """Whether an ``authorization`` value carries ``token``: the scheme ``Bearer`` in any case
    (RFC 7235), the token compared in constant time."""
    parts = got.split(None, 1)
    return len(parts) == 2 and parts[0].lower() == b"bearer" and \
        hmac.compare_digest(parts[1].strip(), token)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str):
        if not token:
            raise ValueError("an empty auth token would let everyone in")
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(EXEMPT_PREFIXES):
            return continuation(handler_call_details)
        got = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                break
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if got is None:
            return _deny(handler, "missing credentials: send `authorization: Bearer <token>`")
        if not bearer_ok(got, self._token):
            log.warning("rejected a call to %s: wrong token", method)
            return _deny(handler, "invalid credentials")
        return handler

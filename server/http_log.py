"""One log line, no traceback, for the HTTP requests aiohttp's parser refuses.

aiohttp answers a malformed request itself (400: a request line or header over 8 KB, both
Content-Length and Transfer-Encoding, a bad method or version...) before any handler runs, and
logs it with ``logger.exception`` on ``aiohttp.server``: a traceback at ERROR for every bad
request a client sends. Those are the caller's mistakes, not the server's: the filter here turns
each into one WARNING line naming the client and the parser's reason. Any other record of that
logger (an unexpected exception) is left as it is.
"""
from __future__ import annotations

import logging

from aiohttp import http_exceptions

SERVER_LOGGER = "aiohttp.server"  # aiohttp.log.server_logger: the web protocol's errors
_MAX_REASON_CHARS = 200


class ParserErrorsInOneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, http_exceptions.HttpProcessingError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            reason = " ".join(str(getattr(exc, "message", "") or exc).split())
            record.msg = "refused a malformed HTTP request from %s: %s (%d)"
            record.args = (peer, reason[:_MAX_REASON_CHARS] or type(exc).__name__,
                           getattr(exc, "code", 400))
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            if record.levelno > logging.WARNING:  # (a first bad method stays at DEBUG)
                record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def install() -> None:
    """Idempotent: one filter on ``aiohttp.server`` per process."""
    logger = logging.getLogger(SERVER_LOGGER)
    if not any(isinstance(f, ParserErrorsInOneLine) for f in logger.filters):
        logger.addFilter(ParserErrorsInOneLine())

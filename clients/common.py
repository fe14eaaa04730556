"""Connection flags shared by the client commands, and the one-line error convention."""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the client (grpc) is imported when a command runs, not for --help
    from .client import Client

TOKEN_ENV = "KVSERVE_AUTH_TOKEN"


def _unsigned_type(top: int):
    def parse(text: str) -> int:
        v = int(text)
        if not 0 <= v <= top:
            raise argparse.ArgumentTypeError(f"must be in [0, {top}], got {v}")
        return v
    parse.__name__ = "integer"  # (argparse's "invalid integer value" for non-numbers)
    return parse


UINT32_MAX, UINT64_MAX = (1 << 32) - 1, (1 << 64) - 1  # the proto's unsigned fields
uint32 = _unsigned_type(UINT32_MAX)  # (their flags)
uint64 = _unsigned_type(UINT64_MAX)


def add_connection_arguments(parser: argparse.ArgumentParser, *, timeout: float = 60.0,
                             retries: int = 3, resume: bool = False) -> None:
    g = parser.add_argument_group("connection")
    g.add_argument("--server", default="127.0.0.1:50051", type=server_address,
                   help="HOST:PORT of a kvserve server (default %(default)s)")
    g.add_argument("--token", default=None,
                   help=f"bearer token (prefer the env var {TOKEN_ENV}, which is used when the "
                        f"flag is absent)")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="CA certificate to verify the server with (enables TLS)")
    g.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    g.add_argument("--tls-server-name", default=None,
                   help="expected name in the server's certificate (when it differs from HOST)")
    g.add_argument("--timeout", type=float, default=timeout,
                   help="seconds per attempt of a call (default %(default)s)")
    g.add_argument("--retries", type=int, default=retries,
                   help="retries on UNAVAILABLE / RESOURCE_EXHAUSTED, with exponential backoff "
                        "and jitter (default %(default)s)")
    if resume:  # the commands that stream
        g.add_argument("--no-resume", action="store_true",
                       help="do not resume a stream cut after tokens were delivered (by "
                            "default it continues on another replica: docs/failover.md)")


def server_address(value: str) -> str:
    """``--server``: HOST:PORT (``[v6]:PORT``), or a gRPC target with a scheme
    (``unix:/path``, ``dns:///host:port``); a bare port or host is refused with a hint."""
    v = value.strip()
    if v.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return v
    m = re.fullmatch(r"(\[[^\]]+\]|[^:\s]+):(\d{1,5})", v)
    if m is None or not 0 < int(m.group(2)) <= 65535:
        hint = f"localhost:{v}" if v.isdigit() else f"{v or 'localhost'}:50051"
        raise argparse.ArgumentTypeError(f"HOST:PORT expected, got {value!r} (e.g. {hint})")
    return v


def client_from_args(args: argparse.Namespace, **kw) -> Client:
    from .client import Client, RetryPolicy

    policy = kw.pop("retry", None) or RetryPolicy(max_attempts=max(0, args.retries) + 1)
    return Client(args.server, token=args.token or os.environ.get(TOKEN_ENV) or None,
                  tls_ca=args.tls_ca, tls=args.tls, server_name=args.tls_server_name,
                  timeout=args.timeout if args.timeout and args.timeout > 0 else None,
                  retry=policy, resume=not getattr(args, "no_resume", False), **kw)


# gRPC names the address it resolved (``ipv6:%5B::1%5D:50071``), not the one the user gave
_UNREACHABLE = re.compile(r"failed to connect to all addresses; last error: \w+: \S+: (.+)$")
_HINTS = {"connection refused": "; is the server running there?",
          "socket closed": "; is it a TLS server? (then --tls or --tls-ca PEM)"}
_RESOLVED = re.compile(r"\b(?:ipv4|ipv6):\S+?(?=:\s)")


def error_line(e: BaseException, server: str | None = None) -> str:
    """``CODE: message`` on one line; with ``server`` (the address as the user gave it), a
    connection failure names that address instead of gRPC's resolved one."""
    from .client import KvserveError

    if not isinstance(e, KvserveError):
        return " ".join(str(e).split()) or type(e).__name__
    msg = e.one_line()
    if server:
        m = _UNREACHABLE.search(msg)
        if m:
            why = m[1].rsplit(": ", 1)[-1]
            hint = _HINTS.get(why.lower(), "")
            return f"{e.code.name}: cannot connect to {server} ({why}){hint}"
        msg = _RESOLVED.sub(server, msg)
    if e.code.name == "UNAUTHENTICATED":  # the CLI's way of sending the token
        msg += f" (give --token or set {TOKEN_ENV})"
    return msg


def fail(command: str, e: BaseException, server: str | None = None) -> int:
    """Print ``kvserve COMMAND: CODE: message`` on one line; return the exit status."""
    print(f"kvserve {command}: {error_line(e, server)}", file=sys.stderr, flush=True)
    return 1

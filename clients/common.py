"""Connection flags shared by the client commands, and the one-line error convention."""
from __future__ import annotations

import argparse
import os
import sys

from .client import Client, KvserveError, RetryPolicy

TOKEN_ENV = "KVSERVE_AUTH_TOKEN"


def add_connection_arguments(parser: argparse.ArgumentParser, *, timeout: float = 60.0,
                             retries: int = 3) -> None:
    g = parser.add_argument_group("connection")
    g.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of a kvserve server "
                                                               "(default %(default)s)")
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


def client_from_args(args: argparse.Namespace, **kw) -> Client:
    policy = kw.pop("retry", None) or RetryPolicy(max_attempts=max(0, args.retries) + 1)
    return Client(args.server, token=args.token or os.environ.get(TOKEN_ENV) or None,
                  tls_ca=args.tls_ca, tls=args.tls, server_name=args.tls_server_name,
                  timeout=args.timeout if args.timeout and args.timeout > 0 else None,
                  retry=policy, **kw)


def fail(command: str, e: BaseException) -> int:
    """Print ``kvserve COMMAND: CODE: message`` on one line; return the exit status."""
    if isinstance(e, KvserveError):
        msg = e.one_line()
    else:
        msg = " ".join(str(e).split()) or type(e).__name__
    print(f"kvserve {command}: {msg}", file=sys.stderr, flush=True)
    return 1

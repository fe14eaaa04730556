#!/usr/bin/env python3
"""Container healthcheck: ask the server's grpc.health.v1 service whether it is SERVING, then
(when KVSERVE_HTTP_PORT is set, or --http-port) the HTTP API's GET /health whether it is ready.

    kvserve-healthcheck [TARGET] [--service NAME] [--timeout SECONDS] [--http-port PORT]

TARGET defaults to 127.0.0.1:$KVSERVE_PORT (50051). The server answers NOT_SERVING until the
model is loaded and warmed up, and again once it drains after SIGTERM. Health is exempt from
the bearer token. With KVSERVE_TLS_CERT set, the server's own certificate is the trust root and
KVSERVE_HEALTHCHECK_TLS_NAME (default localhost) the name checked against it.
Exit 0 when SERVING, 1 otherwise (what Docker's HEALTHCHECK wants).
"""
from __future__ import annotations

import argparse
import os
import sys


def check(target: str, service: str = "kvserve.v1.Inference", timeout: float = 3.0) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cert = os.environ.get("KVSERVE_TLS_CERT", "")
    if cert:
        with open(cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        name = os.environ.get("KVSERVE_HEALTHCHECK_TLS_NAME", "localhost")
        channel = grpc.secure_channel(target, creds,
                                      options=[("grpc.ssl_target_name_override", name)])
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def check_http(host: str, port: int, timeout: float = 3.0) -> str:
    """GET /health of the OpenAI-compatible HTTP API: 200 once warmed up, 503 before/draining."""
    import json
    import ssl
    import urllib.error
    import urllib.request

    cert = os.environ.get("KVSERVE_TLS_CERT", "")
    ctx = None
    if cert:  # the server's own certificate is the trust root; the name is not checked
        ctx = ssl.create_default_context(cafile=cert)
        ctx.check_hostname = False
    url = f"{'https' if cert else 'http'}://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as r:
            return json.load(r).get("status", "?")
    except urllib.error.HTTPError as e:
        return json.load(e).get("status", str(e.code))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvserve-healthcheck", description=__doc__.split("\n")[0])
    p.add_argument("target", nargs="?",
                   default=f"127.0.0.1:{os.environ.get('KVSERVE_PORT') or '50051'}")
    p.add_argument("--service", default="kvserve.v1.Inference",
                   help="health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--http-port", type=int, default=int(os.environ.get("KVSERVE_HTTP_PORT")
                                                        or -1),
                   help="also check GET /health of the HTTP API on the target's host "
                        "(default: $KVSERVE_HTTP_PORT; -1 = no)")
    args = p.parse_args(argv)
    try:
        status = check(args.target, args.service, args.timeout)
    except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"
        code = getattr(e, "code", None)
        print(f"unhealthy: {args.target}: {code() if callable(code) else type(e).__name__}",
              file=sys.stderr)
        return 1
    print(f"{args.target}: {status}")
    if status != "SERVING":
        return 1
    if args.http_port > 0:
        host = args.target.rsplit(":", 1)[0] or "127.0.0.1"
        try:
            http = check_http(host, args.http_port, args.timeout)
        except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"
            print(f"unhealthy: http {host}:{args.http_port}: {type(e).__name__}",
                  file=sys.stderr)
            return 1
        print(f"http {host}:{args.http_port}/health: {http}")
        return 0 if http == "ok" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

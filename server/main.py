"""``kvserve serve ARTIFACTS``: verify, load, warm up, serve; SIGTERM drains and exits 0."""
from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
import sys

from .config import ServerConfig

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifacts", help="artifact directory written by `kvserve export`")
    parser.add_argument("--check-ports", action="store_true",
                        help="only check that the ports (--port, --http-port, --metrics-port) "
                             "are free, then exit: 0 when they are (scripts/main.sh runs it "
                             "before training)")
    ServerConfig.add_arguments(parser)


def check_port(host: str, port: int, flag: str = "port") -> None:
    """Raise OSError with one readable line when ``host:port`` cannot be listened on (in use,
    not an address of this machine, privileged), so that a busy port is reported before the
    model is verified and loaded. ``flag``: the option that sets it (``port``,
    ``metrics-port``). Port 0 (any free port) always works."""
    if port == 0:
        return
    env = "KVSERVE_" + flag.replace("-", "_").upper()
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    failed: list[str] = []
    for family, type_, proto, _, addr in infos:
        with socket.socket(family, type_, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's own listener
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise OSError(f"port {port} on {host} is already in use (another server?): "
                                  f"choose another with --{flag} (env {env}), or 0 for any "
                                  f"free port") from None
                failed.append(e.strerror or str(e))  # e.g. ::1 on a host without IPv6
    if failed and len(failed) == len(infos):
        raise OSError(f"cannot listen on {host}:{port} (--{flag}): {failed[0]}")


def _export_hint(args: argparse.Namespace) -> str:
    """When ARTIFACTS is a checkpoint (``kvserve train`` / ``import-hf`` output), the command that
    makes an artifact of it."""
    from pathlib import Path

    from kvserve.artifact.manifest import MANIFEST

    d = Path(args.artifacts)
    if (d / MANIFEST).is_file() or not (d / "model.safetensors").is_file():
        return ""
    out = Path("artifacts") / (d.resolve().name or "model")
    return (f"; it is a checkpoint: make an artifact of it with "
            f"`kvserve export {args.artifacts} --out {out}`, then serve that")


def check_ports(cfg: ServerConfig) -> None:
    """Every port the server will listen on (gRPC, --http-port, --metrics-port), each free and
    no two the same; raises OSError with one line naming the port and its flag."""
    ports = [("port", cfg.port), ("http-port", cfg.http_port), ("metrics-port", cfg.metrics_port)]
    ports = [(flag, port) for flag, port in ports if port > 0]  # -1 off, 0 any free port
    seen: dict[int, str] = {}
    for flag, port in ports:
        if port in seen:
            raise OSError(f"--{seen[port]} and --{flag} are both {port}: each needs its own port")
        seen[port] = flag
    for flag, port in ports:
        check_port(cfg.host, port, flag)


def main(args: argparse.Namespace) -> int:
    from .app import App, ArtifactError

    try:
        cfg = ServerConfig.from_args(args)
    except ValueError as e:
        print(f"kvserve serve: {e}", file=sys.stderr)
        return 2
    try:  # before the model is verified and loaded: a busy port costs no wait
        check_ports(cfg)
    except OSError as e:
        print(f"kvserve serve: {e}", file=sys.stderr)
        return 1
    if args.check_ports:
        return 0
    log.debug("config: %s", cfg.public_dict())
    # Signals are received synchronously by this thread (sigtimedwait below): blocked here,
    # before any thread exists, every thread inherits the mask, so a SIGTERM is never handled
    # late because it landed on an onnxruntime or gRPC thread.
    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    app = App(args.artifacts, cfg)
    try:
        app.load()
    except ArtifactError as e:
        print(f"kvserve serve: refusing to serve {args.artifacts}: {e}{_export_hint(args)}",
              file=sys.stderr)
        return 1
    try:
        app.start()
    except OSError as e:
        print(f"kvserve serve: {e}", file=sys.stderr)
        app.drain(0)
        return 1
    while True:
        got = signal.sigtimedwait(signals, 1.0)
        # a debugger or sampling profiler attaching (ptrace: py-spy, gdb) can make the wait
        # return a struct of garbage instead of None: only one of ours is a signal
        if got is not None and got.si_signo in signals:
            log.info("received %s", signal.Signals(got.si_signo).name)
            break
        if not app.engine.alive:
            log.error("the engine thread died; stopping")
            app.drain(0)
            return 1
    app.drain()
    return 0

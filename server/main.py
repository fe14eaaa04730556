"""``kvserve serve ARTIFACTS``: verify, load, warm up, serve; SIGTERM drains and exits 0."""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from .config import ServerConfig

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifacts", help="artifact directory written by `kvserve export`")
    ServerConfig.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from .app import App, ArtifactError

    try:
        cfg = ServerConfig.from_args(args)
    except ValueError as e:
        print(f"kvserve serve: {e}", file=sys.stderr)
        return 2
    log.info("config: %s", cfg.public_dict())
    # Signals are received synchronously by this thread (sigtimedwait below): blocked here,
    # before any thread exists, every thread inherits the mask, so a SIGTERM is never handled
    # late because it landed on an onnxruntime or gRPC thread.
    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    app = App(args.artifacts, cfg)
    try:
        app.load()
    except ArtifactError as e:
        print(f"kvserve serve: refusing to serve {args.artifacts}: {e}", file=sys.stderr)
        return 1
    try:
        app.start()
    except OSError as e:
        print(f"kvserve serve: {e}", file=sys.stderr)
        app.drain(0)
        return 1
    while True:
        got = signal.sigtimedwait(signals, 1.0)
        if got is not None:
            log.info("received %s", signal.Signals(got.si_signo).name)
            break
        if not app.engine.alive:
            log.error("the engine thread died; stopping")
            app.drain(0)
            return 1
    app.drain()
    return 0

"""Helpers of the hardening tests (a uniquely named module: ``from conftest import`` is
ambiguous across test directories).

The request builders and ``running_app`` come from tests/kvserve_testing.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


from kvserve_testing import collect, gen_request, running_app, self_signed  # noqa: E402,F401  (re-exported)

HERE = Path(__file__).resolve().parent
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def wait_for(cond, timeout=5.0, interval=0.005):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())


def health(channel, service: str = "", timeout: float = 5.0):
    return health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


# --- Prometheus scrape -------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(metrics_port: int) -> dict[str, float]:
    """GET /metrics over loopback -> {'name{labels}': value} (labels exactly as rendered)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def outcome(samples: dict[str, float], outcome_: str, rpc: str = "Generate") -> float:
    return samples.get(f'kvserve_requests_total{{outcome="{outcome_}",rpc="{rpc}"}}', 0.0)


# --- `kvserve serve` subprocesses -----------------------------------------------------------------
def serve_cmd(artifact_dir, port_file, *extra, step_delay: float = 0.0) -> list[str]:
    """``kvserve serve`` (the console script's entry point). With ``step_delay`` it runs through
    slow_serve.py, which makes every decode step sleep that long first (a slow model, so that
    timing-dependent tests do not depend on this machine's speed)."""
    args = ["serve", str(artifact_dir), "--port", "0", "--port-file", str(port_file),
            "--threads", "1", *map(str, extra)]
    if step_delay:
        return [sys.executable, str(HERE / "slow_serve.py"), str(step_delay), *args]
    return [sys.executable, "-m", "kvserve.cli", *args]


class Served:
    """A ``kvserve serve`` subprocess; stderr goes to a log file."""

    def __init__(self, artifact_dir, tmp: Path, *extra, env=None, step_delay: float = 0.0):
        tmp.mkdir(parents=True, exist_ok=True)
        self.port_file = tmp / "port.json"
        self.port_file.unlink(missing_ok=True)
        self.log_path = tmp / "server.log"
        self._log = open(self.log_path, "w+")
        e = {**os.environ, "KVSERVE_LOG_LEVEL": "INFO", **(env or {})}
        self.proc = subprocess.Popen(serve_cmd(artifact_dir, self.port_file, *extra,
                                               step_delay=step_delay),
                                     stdout=subprocess.DEVNULL, stderr=self._log, env=e)
        self.port = self.metrics_port = None
        self.channel = None

    def wait_ready(self, timeout: float = 90.0) -> "Served":
        ok = wait_for(lambda: self.port_file.exists() or self.proc.poll() is not None, timeout,
                      interval=0.05)
        assert ok and self.proc.poll() is None, f"server did not start:\n{self.log()}"
        info = json.loads(self.port_file.read_text())
        self.port, self.metrics_port = info["port"], info["metrics_port"]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        grpc.channel_ready_future(self.channel).result(timeout=10)
        return self

    def log(self) -> str:
        return self.log_path.read_text()

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@contextlib.contextmanager
def served(artifact_dir, tmp: Path, *extra, env=None, step_delay: float = 0.0):
    s = Served(artifact_dir, tmp, *extra, env=env, step_delay=step_delay)
    try:
        yield s.wait_ready()
    finally:
        s.close()


def slow_decode(monkeypatch, app, seconds: float) -> None:
    """In-process: every model step of ``app`` (decode, and speculation's verify) sleeps
    ``seconds`` first (a slow model), and makes one token (speculation off: on the looping
    test model a verification yields up to 9, and the tests pace requests by steps)."""
    monkeypatch.setattr(app.engine.runner, "spec", None)
    for name in ("decode", "verify"):
        orig = getattr(app.lm, name)

        def slowed(*a, _orig=orig, **kw):
            time.sleep(seconds)
            return _orig(*a, **kw)

        monkeypatch.setattr(app.lm, name, slowed)


def held_decode(monkeypatch, app, hold, seconds: float, timeout: float = 60.0
                ) -> threading.Event:
    """In-process: every model step of ``app`` sleeps ``seconds`` (as ``slow_decode``) and,
    once ``hold()`` is true, waits until the returned Event is set: from then on the model
    makes no progress until the test says so (``timeout`` only keeps a broken test from
    hanging). ``hold`` runs on the engine thread, before the step."""
    go = threading.Event()
    for name in ("decode", "verify"):  # every model step (speculation's verify too)
        orig = getattr(app.lm, name)

        def step(*a, _orig=orig, **kw):
            if not go.is_set() and hold():
                go.wait(timeout)
            time.sleep(seconds)
            return _orig(*a, **kw)

        monkeypatch.setattr(app.lm, name, step)
    return go


# --- TLS -----------------------------------------------------------------------------------------

"""Helpers of the client tests (a module name of its own: `from conftest import ...` is ambiguous
when several test directories have a conftest.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from kvserve_testing import free_port, running_app  # noqa: F401  (re-exported)


class ServeProcess:
    """``kvserve serve`` in a subprocess on a fixed port; ``restart()`` keeps the port."""

    def __init__(self, artifact_dir: Path, workdir: Path, *extra: str):
        self.dir, self.workdir, self.extra = artifact_dir, workdir, extra
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        self.starts += 1
        port_file = self.workdir / f"port{self.starts}.json"
        log = (self.workdir / f"serve{self.starts}.log").open("wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "KVSERVE_LOG_LEVEL": "WARNING"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "serve", str(self.dir), "--port",
             str(self.port), "--threads", "1", "--max-batch", "2", "--drain-grace", "5",
             "--port-file", str(port_file), *self.extra],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvserve serve did not start:\n" + self.log_text())
            time.sleep(0.05)
        assert json.loads(port_file.read_text())["port"] == self.port

    def log_text(self) -> str:
        return (self.workdir / f"serve{self.starts}.log").read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def run_cli(*argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """``kvserve ARGV`` in a subprocess (its own stdout/stderr, exit status)."""
    env = {**os.environ, "KVSERVE_LOG_LEVEL": "WARNING"}
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)

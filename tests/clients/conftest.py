"""Client test fixtures: the server tests' tiny artifact and real servers on loopback (in-process
``App`` from tests/server/conftest.py, or a ``kvserve serve`` subprocess that can be restarted
on the same port)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

_SERVER_CONFTEST = Path(__file__).resolve().parent.parent / "server" / "conftest.py"


def _load_server_fixtures():
    """tests/server/conftest.py as a module of its own (its helpers, not its fixtures)."""
    spec = importlib.util.spec_from_file_location("kvserve_tests_server_conftest",
                                                  _SERVER_CONFTEST)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


server_fixtures = _load_server_fixtures()
running_app = server_fixtures.running_app


@pytest.fixture(scope="session")
def artifact(tmp_path_factory):
    """The server tests' tiny artifact (random init, fixed seed) and its torch model."""
    return server_fixtures.build_artifact(tmp_path_factory.mktemp("clients_artifact"))


@pytest.fixture(scope="session")
def app(artifact):
    with running_app(artifact) as a:
        yield a


@pytest.fixture(scope="session")
def target(app) -> str:
    return f"127.0.0.1:{app.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture
def serve_process(artifact, tmp_path):
    procs: list[ServeProcess] = []

    def make(*extra: str) -> ServeProcess:
        p = ServeProcess(artifact.dir, tmp_path, *extra)
        procs.append(p)
        p.start()
        return p

    yield make
    for p in procs:
        p.stop()


def run_cli(*argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """``kvserve ARGV`` in a subprocess (its own stdout/stderr, exit status)."""
    env = {**os.environ, "KVSERVE_LOG_LEVEL": "WARNING"}
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture
def cli(capsys):
    """Run ``kvserve ARGV`` in this process (faster than a subprocess): returns
    (status, stdout, stderr)."""
    from kvserve import cli as kvserve_cli

    def call(*argv: str):
        capsys.readouterr()
        rc = kvserve_cli.main(list(argv))
        out = capsys.readouterr()
        return rc, out.out, out.err

    return call

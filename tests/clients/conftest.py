"""Client test fixtures: real servers on loopback for the shared tiny artifact (tests/conftest.py):
an in-process ``App`` (tests/server/conftest.py's running_app) or a ``kvserve serve`` subprocess
that can be restarted on the same port."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest

pytest.importorskip("torch")

from client_helpers import ServeProcess, running_app  # noqa: E402
from kvserve.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402


@pytest.fixture(scope="session")
def app(artifact):
    with running_app(artifact) as a:
        yield a


@pytest.fixture(scope="session")
def target(app) -> str:
    return f"127.0.0.1:{app.port}"


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


@pytest.fixture
def scripted():
    """make(servicer) -> the address of a real gRPC server on loopback running that servicer
    (a scripted stand-in for kvserve's: refusals, broken streams), stopped after the test."""
    servers = []

    def make(servicer):
        s = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_InferenceServicer_to_server(servicer, s)
        port = s.add_insecure_port("127.0.0.1:0")
        s.start()
        servers.append(s)
        return f"127.0.0.1:{port}"

    yield make
    for s in servers:
        s.stop(0)

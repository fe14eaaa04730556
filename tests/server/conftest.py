"""Server test fixtures: one real gRPC server on loopback for the session's tiny artifact
(``artifact`` from tests/conftest.py), its channel and stub."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")  # the artifact fixture builds the tiny model with torch

from kvserve_testing import ready_channel, running_app  # noqa: E402


@pytest.fixture(scope="session")
def app(artifact):
    with running_app(artifact, metrics_port=0, max_logits_floats=50_000,
                     max_attention_floats=50_000) as a:
        yield a


@pytest.fixture(scope="session")
def channel(app):
    with ready_channel(app.port) as ch:
        yield ch


@pytest.fixture(scope="session")
def stub(channel):
    from kvserve.v1 import inference_pb2_grpc

    return inference_pb2_grpc.InferenceStub(channel)

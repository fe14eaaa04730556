"""Fixtures of the hardening tests: one in-process server with small caps, shared by the
bad-input matrix, the fuzz tests and the cancellation tests (the ``artifact`` fixture is the
session's tiny model from tests/conftest.py)."""
from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest

pytest.importorskip("torch")  # the artifact fixture builds the tiny model with torch

from hardening_helpers import health, running_app, SERVING  # noqa: E402

from kvserve.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402

# caps small enough that every size limit can be exceeded with the tiny model (vocab 512,
# context 256), and a receive limit of a few MiB (it is derived from the caps)
CAPS = dict(max_logits_floats=50_000, max_attention_floats=50_000, max_score_tokens=4096,
            max_batch=4, max_queue=16, metrics_port=0)


@dataclass
class Srv:
    app: object
    channel: grpc.Channel
    stub: pb_grpc.InferenceStub

    def healthy(self) -> bool:
        return health(self.channel) == SERVING and self.app.engine.alive


@pytest.fixture(scope="session")
def hsrv(artifact):
    with running_app(artifact, **CAPS) as app:
        ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
        grpc.channel_ready_future(ch).result(timeout=10)
        yield Srv(app, ch, pb_grpc.InferenceStub(ch))
        ch.close()

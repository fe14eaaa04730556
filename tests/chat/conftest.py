"""Chat fixtures: a tiny model whose artifact carries a ChatML template, served over gRPC and the
OpenAI-compatible HTTP API (bearer token on), and the official openai client against it."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from chat_helpers import TOKEN  # noqa: E402
from kvserve_testing import build_chat_artifact, ready_channel, running_app  # noqa: E402



@pytest.fixture(scope="session")
def chat_artifact(tmp_path_factory):
    return build_chat_artifact(tmp_path_factory.mktemp("chat_artifact"))


@pytest.fixture(scope="session")
def chat_app(chat_artifact):
    with running_app(chat_artifact, http_port=0, auth_token=TOKEN, max_batch=8, max_queue=32,
                     max_http_body_bytes=1 << 20, max_chat_messages=8,
                     max_chat_chars=2000) as a:
        yield a


@pytest.fixture(scope="session")
def base_url(chat_app):
    return f"http://127.0.0.1:{chat_app.http_port}"


@pytest.fixture()
def oai(base_url):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=base_url + "/v1", api_key=TOKEN, max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def chat_stub(chat_app):
    from kvserve.v1 import inference_pb2_grpc as pb_grpc

    with ready_channel(chat_app.port) as ch:
        yield pb_grpc.InferenceStub(ch)



@pytest.fixture(scope="session")
def tools_artifact(tmp_path_factory):
    from tools_artifact import build_tools_artifact

    return build_tools_artifact(tmp_path_factory.mktemp("tools_artifact"))


@pytest.fixture(scope="session")
def tools_app(tools_artifact):
    with running_app(tools_artifact, http_port=0, auth_token=TOKEN, max_batch=8,
                     max_queue=32) as a:
        yield a


@pytest.fixture()
def tools_oai(tools_app):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"http://127.0.0.1:{tools_app.http_port}/v1", api_key=TOKEN,
                       max_retries=0, timeout=120) as c:
        yield c

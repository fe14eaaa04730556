"""Bearer-token auth and TLS, completing tests/server/test_lifecycle.py::test_tls_and_bearer_auth
(which covers Generate/ModelInfo/Tokenize with TLS): every Inference method refuses a missing
or wrong token with UNAUTHENTICATED and serves the right one, the refusal never echoes a token,
health (Check and Watch) is exempt, reflection is not, auth holds on a plaintext port too, and
TLS with a certificate made here: a round trip through the kvserve client library, and a client
that does not trust the certificate never gets through.
"""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from hardening_helpers import SERVING, collect, gen_request, running_app, self_signed

from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc

TOKEN = "hardening-t0ken"
GOOD = [("authorization", f"Bearer {TOKEN}")]
BAD = {
    "missing": (None, "missing credentials"),
    "wrong": ([("authorization", "Bearer nope-nope")], "invalid credentials"),
    "no-scheme": ([("authorization", TOKEN)], "invalid credentials"),
    "other-scheme": ([("authorization", f"Basic {TOKEN}")], "invalid credentials"),
    "token-prefix": ([("authorization", f"Bearer {TOKEN[:-1]}")], "invalid credentials"),
    "token-and-more": ([("authorization", f"Bearer {TOKEN} x")], "invalid credentials"),
    "other-header": ([("x-api-key", TOKEN)], "missing credentials"),
}
# RFC 7235: the scheme is case-insensitive; the space around the token is not part of it
ALSO_GOOD = {"lowercase-scheme": [("authorization", f"bearer {TOKEN}")],
             "spaces": [("authorization", f"BEARER   {TOKEN} ")]}
CALLS = {
    "Generate": lambda s, md: collect(s.Generate(gen_request("x", 2), metadata=md, timeout=10)),
    "Score": lambda s, md: s.Score(pb.ScoreRequest(texts=["ab"]), metadata=md, timeout=10),
    "Tokenize": lambda s, md: s.Tokenize(pb.TokenizeRequest(texts=["a"]), metadata=md,
                                         timeout=10),
    "Detokenize": lambda s, md: s.Detokenize(pb.DetokenizeRequest(
        token_ids=[pb.TokenIds(ids=[5])]), metadata=md, timeout=10),
    "ModelInfo": lambda s, md: s.ModelInfo(pb.ModelInfoRequest(), metadata=md, timeout=10),
}


@pytest.fixture(scope="module")
def tls_server(artifact, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    cert, key, pem = self_signed(tmp)
    with running_app(artifact, tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN) as app:
        ch = grpc.secure_channel(f"localhost:{app.port}",
                                 grpc.ssl_channel_credentials(root_certificates=pem))
        yield app, ch, pem, cert
        ch.close()


@pytest.mark.parametrize("method", CALLS)
@pytest.mark.parametrize("bad", BAD)
def test_every_method_refuses_bad_credentials(tls_server, method, bad):
    _, ch, _, _ = tls_server
    md, message = BAD[bad]
    with pytest.raises(grpc.RpcError) as e:
        CALLS[method](pb_grpc.InferenceStub(ch), md)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert message in e.value.details()
    assert TOKEN not in e.value.details() and "nope" not in e.value.details()


@pytest.mark.parametrize("method", CALLS)
def test_every_method_serves_the_right_token(tls_server, method):
    _, ch, _, _ = tls_server
    assert CALLS[method](pb_grpc.InferenceStub(ch), GOOD)


@pytest.mark.parametrize("form", ALSO_GOOD)
def test_the_scheme_is_case_insensitive(tls_server, form):
    _, ch, _, _ = tls_server
    assert CALLS["ModelInfo"](pb_grpc.InferenceStub(ch), ALSO_GOOD[form])


def test_health_is_exempt_reflection_is_not(tls_server):
    _, ch, _, _ = tls_server
    h = health_pb2_grpc.HealthStub(ch)
    assert h.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
    watch = h.Watch(health_pb2.HealthCheckRequest(service="kvserve.v1.Inference"), timeout=5)
    assert next(watch).status == SERVING
    watch.cancel()
    r = reflection_pb2_grpc.ServerReflectionStub(ch)
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    with pytest.raises(grpc.RpcError) as e:
        next(r.ServerReflectionInfo(iter([req]), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    resp = next(r.ServerReflectionInfo(iter([req]), metadata=GOOD, timeout=5))
    assert "kvserve.v1.Inference" in {s.name for s in resp.list_services_response.service}


def test_tls_round_trip_with_the_client_library(tls_server):
    from kvserve.clients import Client, KvserveError

    app, _, _, cert = tls_server
    with Client(f"localhost:{app.port}", tls_ca=str(cert), token=TOKEN, timeout=10) as c:
        done = c.generate("def f():", max_new_tokens=3)
        assert done.generated_tokens == 3
        assert c.tokenize(["abc"])
    with Client(f"localhost:{app.port}", tls_ca=str(cert), token="wrong", timeout=10) as c:
        with pytest.raises(KvserveError) as e:
            c.tokenize(["abc"])
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and e.value.attempts == 1


def test_tls_refuses_a_client_that_does_not_trust_the_certificate(tls_server, tmp_path):
    app, _, _, _ = tls_server
    _, _, other_ca = self_signed(tmp_path)  # a different certificate
    ch = grpc.secure_channel(f"localhost:{app.port}",
                             grpc.ssl_channel_credentials(root_certificates=other_ca))
    with pytest.raises(grpc.RpcError) as e:
        pb_grpc.InferenceStub(ch).ModelInfo(pb.ModelInfoRequest(), metadata=GOOD, timeout=3)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    ch.close()


def test_auth_without_tls(artifact):
    """The token is checked on a plaintext port too (for a TLS-terminating proxy in front)."""
    with running_app(artifact, auth_token=TOKEN) as app:
        ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
        stub = pb_grpc.InferenceStub(ch)
        for md, message in BAD.values():
            with pytest.raises(grpc.RpcError) as e:
                CALLS["Generate"](stub, md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert message in e.value.details()
        assert CALLS["Generate"](stub, GOOD)[1].generated_tokens == 2
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status == \
            SERVING
        ch.close()

"""Cancellation, deadlines, overload, health, reflection, metrics, auth, TLS, SIGTERM drain,
artifact verification and configuration."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvserve_testing import collect, gen_request, running_app, self_signed
from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc

SLOW = dict(attention=pb.AttentionOptions(layers=[0, 1]), return_logits=True, top_logprobs=20)


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _slowed(monkeypatch, app, seconds: float) -> None:
    """Every decode step of ``app`` sleeps first, and makes one token (speculation off: a
    verification of the looping test model yields up to 9): a generation outlasts the test's
    next steps on a loaded machine (240 tokens of the tiny model otherwise take ~50 ms)."""
    decode = app.lm.decode

    def slow(*a, **kw):
        time.sleep(seconds)
        return decode(*a, **kw)

    monkeypatch.setattr(app.lm, "decode", slow)
    monkeypatch.setattr(app.engine.runner, "spec", None)


def test_cancellation_frees_the_slot(stub, app, monkeypatch):
    _slowed(monkeypatch, app, 0.01)
    call = stub.Generate(gen_request("x", 240))
    next(call)
    assert app.engine.load()["running"] == 1
    call.cancel()
    assert wait_for(lambda: app.engine.load()["running"] == 0, 2.0)
    with pytest.raises(grpc.RpcError) as e:
        collect(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert app.metrics.requests.get(rpc="Generate", outcome="cancelled") >= 1


def test_deadline_exceeded_stops_the_work(stub, app, monkeypatch):
    # 240 steps of 20 ms: the work outlasts the 50 ms deadline, and stopping it within 2 s
    # is the deadline's doing (unslowed, speculation made the 240 tokens of this looping
    # model in under 50 ms on a fast machine, and the call ended normally)
    _slowed(monkeypatch, app, 0.02)
    before = app.metrics.requests.get(rpc="Generate", outcome="time_limit")
    with pytest.raises(grpc.RpcError) as e:
        collect(stub.Generate(gen_request("x", 240, top_logprobs=20), timeout=0.05))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: app.engine.load()["running"] == 0, 2.0)
    assert wait_for(lambda: app.metrics.requests.get(rpc="Generate", outcome="time_limit")
                    + app.metrics.requests.get(rpc="Generate", outcome="cancelled") > before)


def test_overload_is_resource_exhausted_and_queued_requests_are_cancellable(artifact,
                                                                            monkeypatch):
    with running_app(artifact, max_batch=1, max_queue=1) as app:
        _slowed(monkeypatch, app, 0.005)  # a holds its slot while the rest happens
        ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
        stub = pb_grpc.InferenceStub(ch)
        a = stub.Generate(gen_request("x", 240, **SLOW))
        next(a)  # a holds the only slot
        b = stub.Generate(gen_request("y", 4))  # waits in the queue
        assert wait_for(lambda: app.engine.load()["queued"] == 1, 2.0)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            collect(stub.Generate(gen_request("z", 4)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - t0 < 1.0  # immediately, not after waiting
        b.cancel()  # a queued request leaves the queue
        assert wait_for(lambda: app.engine.load()["queued"] == 0, 2.0)
        chunks, done = collect(a)
        assert done.generated_tokens == 240
        ch.close()


def test_health_reflection_and_metrics(channel, app, stub):
    h = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvserve.v1.Inference"):
        assert h.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    r = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"kvserve.v1.Inference", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    url = f"http://127.0.0.1:{app.metrics_server.port}/metrics"
    scrape = lambda: urllib.request.urlopen(url, timeout=5).read().decode()  # noqa: E731

    def val(body: str, sample: str) -> float:
        m = re.search("^" + re.escape(sample) + r" (\S+)$", body, re.M)
        return float(m.group(1)) if m else 0.0

    done = 'kvserve_requests_total{outcome="length",rpc="Generate"}'
    before = scrape()
    collect(stub.Generate(gen_request("x", 3)))
    body = scrape()
    for name in ("kvserve_queue_size", "kvserve_running_sequences",
                 "kvserve_time_to_first_token_seconds_bucket",
                 "kvserve_inter_token_latency_seconds_count", "kvserve_generated_tokens_total",
                 done, "process_resident_memory_bytes", "process_cpu_seconds_total"):
        assert name in body
    assert val(body, done) == val(before, done) + 1
    assert (val(body, "kvserve_generated_tokens_total")
            == val(before, "kvserve_generated_tokens_total") + 3)


def test_tls_and_bearer_auth(artifact, tmp_path):
    cert_path, key_path, cert = self_signed(tmp_path)
    with running_app(artifact, tls_cert=str(cert_path), tls_key=str(key_path),
                     auth_token="s3cret") as app:
        creds = grpc.ssl_channel_credentials(root_certificates=cert)
        ch = grpc.secure_channel(f"localhost:{app.port}", creds)
        stub = pb_grpc.InferenceStub(ch)
        ok = [("authorization", "Bearer s3cret")]
        chunks, done = collect(stub.Generate(gen_request("x", 3), metadata=ok))
        assert done.generated_tokens == 3
        assert stub.Tokenize(pb.TokenizeRequest(texts=["a"]), metadata=ok).tokens
        for md in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
            with pytest.raises(grpc.RpcError) as e:
                collect(stub.Generate(gen_request("x", 3), metadata=md))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfo(pb.ModelInfoRequest(), metadata=md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # health is exempt
        h = health_pb2_grpc.HealthStub(ch)
        assert h.Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.SERVING
        ch.close()
        # plaintext to a TLS port fails
        plain = grpc.insecure_channel(f"127.0.0.1:{app.port}")
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.InferenceStub(plain).ModelInfo(pb.ModelInfoRequest(), metadata=ok,
                                                   timeout=2)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        plain.close()


def _serve(artifact_dir, tmp_path, *extra, env=None):
    port_file = tmp_path / "port.json"
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", str(artifact_dir), "--port", "0",
           "--port-file", str(port_file), "--threads", "1", *extra]
    e = {**os.environ, **(env or {})}
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=e)
    return proc, port_file


def test_sigterm_drains_in_flight_streams_then_exits_0(artifact, tmp_path):
    import concurrent.futures

    proc, port_file = _serve(artifact.dir, tmp_path, "--drain-grace", "60", "--metrics-port", "0",
                             env={"KVSERVE_MAX_BATCH": "1"})
    try:
        assert wait_for(port_file.exists, 60), (tmp_path / "server.log").read_text()
        port = json.loads(port_file.read_text())["port"]
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.InferenceStub(ch)
        assert stub.ModelInfo(pb.ModelInfoRequest()).limits.max_batch == 1  # env var applied
        # one slot, several long requests: most are still running or queued at SIGTERM
        mport = json.loads(port_file.read_text())["metrics_port"]

        def accepted():  # running + queued + finished (warm-up requests are not counted)
            text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics").read().decode()
            val = lambda pat: float(re.search("^" + pat, text, re.M).group(1))  # noqa: E731
            done = re.search(r'requests_total\{outcome="length",rpc="Generate"\} (\S+)', text)
            return (val(r"kvserve_queue_size (\S+)") + val(r"kvserve_running_sequences (\S+)")
                    + (float(done.group(1)) if done else 0))

        before = accepted()  # whatever the warm-up left counted
        calls = [stub.Generate(gen_request("x", 240, **SLOW)) for _ in range(12)]
        next(calls[0])
        assert wait_for(lambda: accepted() - before == len(calls), 10)  # every call arrived
        proc.send_signal(signal.SIGTERM)
        # the signal is handled by the server's main thread, asynchronously: wait until the
        # drain has begun (health NOT_SERVING comes right after the refusal of new calls), or
        # on a busy machine "y" can arrive first, be queued and finish within its deadline
        h = health_pb2_grpc.HealthStub(ch)
        assert wait_for(lambda: h.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                        == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        with pytest.raises(grpc.RpcError) as e:
            collect(stub.Generate(gen_request("y", 2), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
            results = list(pool.map(collect, calls))
        for i, (chunks, done) in enumerate(results):
            assert done.finish_reason == pb.FINISH_REASON_LENGTH
            assert done.generated_tokens == len(chunks) + (i == 0) == 240
        assert proc.wait(timeout=30) == 0
        log = (tmp_path / "server.log").read_text()
        queued = int(re.search(r"draining: .*'queued': (\d+)", log).group(1))
        assert queued >= 1, "the in-flight work had finished before SIGTERM was handled"
        ch.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_a_tampered_artifact(artifact, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(artifact.dir, bad)
    with open(bad / "model.onnx.data", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    proc, _ = _serve(bad, tmp_path)
    assert proc.wait(timeout=60) == 1
    err = (tmp_path / "server.log").read_text()
    assert "refusing to serve" in err and "model.onnx.data" in err


def test_server_config_flags_env_and_bounds():
    import argparse

    from kvserve.server.config import ServerConfig

    p = argparse.ArgumentParser()
    ServerConfig.add_arguments(p)
    env = {"KVSERVE_MAX_BATCH": "3", "KVSERVE_PORT": "6000", "KVSERVE_ATTENTION": "false"}
    cfg = ServerConfig.from_args(p.parse_args(["--port", "7000"]), environ=env)
    assert (cfg.port, cfg.max_batch, cfg.attention) == (7000, 3, False)  # flag > env > default
    assert ServerConfig.from_args(p.parse_args([]), environ={}).port == 50051
    with pytest.raises(ValueError, match="max_batch"):
        ServerConfig.from_args(p.parse_args(["--max-batch", "0"]), environ={})
    for bad in ("-1", "65537"):
        with pytest.raises(ValueError, match="prefill_chunk_tokens"):
            ServerConfig.from_args(p.parse_args(["--prefill-chunk-tokens", bad]), environ={})
    # every numeric setting has a ceiling as well as a floor
    import dataclasses

    from kvserve.server.config import _BOUNDS
    assert {f.name for f in dataclasses.fields(ServerConfig) if f.type in ("int", "float")} \
        == {name for name, _, _ in _BOUNDS} | {"max_temperature", "default_max_new_tokens"}
    for bad in (0.0, 2e6):
        with pytest.raises(ValueError, match="max_temperature"):
            ServerConfig(max_temperature=bad).validate()
    for name, lo, hi in _BOUNDS:
        for bad in (lo - 1, hi * 2 + 1):
            with pytest.raises(ValueError, match=name):
                ServerConfig(**{name: type(getattr(ServerConfig(), name))(bad)}).validate()
    with pytest.raises(ValueError, match="stream_interval_max_ms must be at least"):
        ServerConfig(stream_interval_ms=20.0, stream_interval_max_ms=10.0).validate()
    # each within its bounds, together past what one gRPC message can carry: refused at start
    with pytest.raises(ValueError, match="2 GiB"):
        ServerConfig(max_top_logprobs=1024)
    ServerConfig(max_top_logprobs=1024, max_score_tokens=32_768)
    with pytest.raises(ValueError, match="KVSERVE_THREADS"):
        ServerConfig.from_args(p.parse_args([]), environ={"KVSERVE_THREADS": "many"})
    assert "s3" not in str(ServerConfig(auth_token="s3").public_dict())


def test_server_package_does_not_import_torch():
    code = ("import sys, kvserve.server.main, kvserve.server.app, kvserve.server.engine; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_profiler_attaching_does_not_stop_the_server(artifact, tmp_path):
    """py-spy samples a serving process by ptrace; CPython's sigtimedwait, interrupted by an
    attach, can return a struct of garbage instead of None: it was taken for a signal and the
    server died (a ValueError naming no signal) with its streams cut."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).is_file():
        pytest.skip("py-spy is not installed (the test extra has it)")
    proc, port_file = _serve(artifact.dir, tmp_path)
    try:
        assert wait_for(port_file.exists, 60), (tmp_path / "server.log").read_text()
        port = json.loads(port_file.read_text())["port"]
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.InferenceStub(ch)
        assert stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).limits.max_batch >= 1
        spy_run = subprocess.Popen([spy, "record", "--rate", "500", "--duration", "3",
                                    "--format", "raw", "--output", str(tmp_path / "spy.txt"),
                                    "--pid", str(proc.pid)], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        served = 0
        while spy_run.poll() is None:  # streams served while it samples: none is cut
            chunks, done = collect(stub.Generate(gen_request("x", 64, **SLOW), timeout=60))
            assert done.finish_reason == pb.FINISH_REASON_LENGTH
            assert done.generated_tokens == len(chunks) == 64
            served += 1
        out = spy_run.stdout.read()
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        if spy_run.returncode != 0:  # (the server is alive: py-spy could not attach, e.g.
            pytest.skip(f"py-spy could not sample here: {out.strip()[:200]}")  # no ptrace)
        assert served >= 1
        assert stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).limits.max_batch >= 1
        ch.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()


def test_time_limit_in_the_queue_is_resource_exhausted(artifact, monkeypatch):
    """--request-time-limit counts from submission: a request that spends all of it waiting
    for a slot never started, and is told so with a retryable status (gRPC
    RESOURCE_EXHAUSTED, HTTP 429), not an empty success; one that ran ends with Complete,
    TIME_LIMIT, and the tokens it made."""
    import threading

    with running_app(artifact, max_batch=1, request_time_limit=0.5, http_port=0) as app:
        gate = threading.Event()
        decode = app.lm.decode

        def held(*a, **kw):  # the engine's step waits until both requests' limits passed
            gate.wait(30)
            return decode(*a, **kw)

        monkeypatch.setattr(app.lm, "decode", held)
        monkeypatch.setattr(app.engine.runner, "spec", None)
        ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
        stub = pb_grpc.InferenceStub(ch)
        a = stub.Generate(gen_request("x", 50))
        next(a)  # a holds the only slot; its first step waits at the gate
        b = stub.Generate(gen_request("y", 4))
        assert wait_for(lambda: app.engine.load()["queued"] == 1, 5.0)
        http = {}

        def post(n=1):
            req = urllib.request.Request(
                f"http://127.0.0.1:{app.http_port}/v1/completions",
                json.dumps({"model": "artifact", "prompt": [5, 6, 7], "max_tokens": 40,
                            "n": n, "ignore_eos": True}).encode(),  # (ends by its limit,
                {"Content-Type": "application/json"})  # not by an early EOS: CI's once did)
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    http["status"], http["body"] = r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                http["status"], http["body"] = e.code, json.loads(e.read())

        t = threading.Thread(target=post)
        t.start()
        assert wait_for(lambda: app.engine.load()["queued"] == 2, 5.0)
        time.sleep(0.6)  # past both queued requests' limits
        gate.set()
        with pytest.raises(grpc.RpcError) as e:
            collect(b)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert re.fullmatch(r"the server is at capacity: the request waited \d+\.\d s for a "
                            r"batch slot, up to its time limit, and never started; retry later",
                            e.value.details()), e.value.details()
        t.join(30)
        assert app.metrics.requests.get(rpc="Generate", outcome="queued_out") == 2
        assert http["status"] == 429, http
        assert http["body"]["error"]["code"] == "rate_limit_exceeded"
        assert "never started" in http["body"]["error"]["message"]
        chunks, done = collect(a)  # it ran: its tokens, then TIME_LIMIT
        assert done.finish_reason == pb.FINISH_REASON_TIME_LIMIT
        assert 1 <= done.generated_tokens < 50
        ch.close()
        # n = 2 over one slot: the second choice waits behind the first until both limits
        # pass; part of the request ran, so it is an answer (the waiting choice empty,
        # "length"), not a 429 that every retry would meet again
        gate.clear()
        t = threading.Thread(target=post, kwargs=dict(n=2))
        http.clear()
        t.start()
        assert wait_for(lambda: app.engine.load()["queued"] == 1, 5.0)
        time.sleep(0.6)
        gate.set()
        t.join(30)
        assert http["status"] == 200, http
        first, second = sorted(http["body"]["choices"], key=lambda c: c["index"])
        assert first["text"] and first["finish_reason"] == "length"
        assert second["text"] == "" and second["finish_reason"] == "length"

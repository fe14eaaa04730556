"""The repository's own nginx config, run by a real nginx on loopback in front of two real
`kvserve serve` processes configured by the compose file's KVSERVE_* environment (only addresses
and ports differ from the compose deployment):

- unary calls over ONE client channel are spread over both replicas (each replica's own
  /metrics counts the calls it served);
- a streaming Generate works through the balancer, token for token equal to a direct call;
- grpc.health.v1 answers through the balancer, and docker/healthcheck.py (the image's
  HEALTHCHECK) works against a replica and through the balancer;
- after SIGKILL of one replica the same channel keeps working through the other; with both
  gone the caller gets UNAVAILABLE at once;
- docker/build-model.sh (the model-builder's entry point) is idempotent on a verified artifact;
- the OpenAI-compatible HTTP API of the replicas answers through the balancer's HTTP listener
  (/health, a streamed completion equal to a direct one, requests spread over both replicas),
  and the healthcheck's HTTP check works against a replica.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy_helpers import (NGINX_CONF, NGINX_TEMPLATE, REPO, compose_yaml, find_nginx,
                            free_port, free_ports, nginx_prefix_and_processes, read_json,
                            render_template, wait_until)

torch = pytest.importorskip("torch")  # the test artifact is exported from a torch model
grpc = pytest.importorskip("grpc")
NGINX = find_nginx()
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (.ci/run installs "
                                                      "it with apt-get install -y nginx)")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from kvserve.v1 import inference_pb2 as pb  # noqa: E402
from kvserve.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402

HEALTHCHECK = REPO / "docker" / "healthcheck.py"
BUILD_MODEL = REPO / "docker" / "build-model.sh"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """The server tests' tiny model (same corpus, preset and seed) through the real export
    pipeline (parity gate, manifest); no attention graphs, which the balancer does not need."""
    from kvserve_testing import build_artifact

    root = tmp_path_factory.mktemp("deploy_artifact")
    return build_artifact(root, attention=False, out_name="models/current").dir


# --- the cluster ------------------------------------------------------------------------------
@dataclass
class Replica:
    name: str
    port: int
    metrics_port: int
    proc: subprocess.Popen
    log: Path
    http_port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=5).read().decode()

    def count(self, rpc: str, outcome: str = "ok") -> float:
        m = re.search(r'^kvserve_requests_total\{outcome="%s",rpc="%s"\} (\S+)$'
                      % (outcome, rpc), self.metrics(), re.M)
        return float(m.group(1)) if m else 0.0


@dataclass
class Cluster:
    replicas: list[Replica]
    lb_port: int
    status_port: int
    nginx: subprocess.Popen
    prefix: Path
    http_port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.lb_port}"

    def nginx_log(self) -> str:
        return "".join((self.prefix / f).read_text(errors="replace")
                       for f in ("nginx.out", "nginx.err") if (self.prefix / f).exists())


def _server_env(compose: dict, name: str, artifact: Path, port: int, metrics_port: int,
                port_file: Path, http_port: int) -> dict[str, str]:
    env = {k: str(v) for k, v in compose["services"][name]["environment"].items()}
    assert env["KVSERVE_HTTP_PORT"]  # the compose file turns the HTTP API on
    env.update(KVSERVE_MODEL_DIR=str(artifact), KVSERVE_HOST="127.0.0.1",
               KVSERVE_PORT=str(port), KVSERVE_METRICS_PORT=str(metrics_port),
               KVSERVE_HTTP_PORT=str(http_port),
               KVSERVE_PORT_FILE=str(port_file),
               # two servers, nginx and the test share 2 cores; a fast teardown
               KVSERVE_THREADS="1", KVSERVE_DRAIN_GRACE="2", KVSERVE_LOG_LEVEL="WARNING")
    return {**os.environ, "OMP_NUM_THREADS": "1", **env}


def _render_nginx(compose: dict, prefix: Path, ports: dict[str, int], lb_port: int,
                  status_port: int, http_ports: dict[str, int], lb_http_port: int) -> Path:
    """deploy/nginx/nginx.conf + the compose nginx service's KVSERVE_LB_* values rendered into
    templates/kvserve.conf.template, with the replicas' service names and ports replaced by
    the loopback ones."""
    env = {k: str(v) for k, v in compose["services"]["nginx"]["environment"].items()}
    servers = env["KVSERVE_LB_SERVERS"]
    for name, port in ports.items():
        compose_port = compose["services"][name]["environment"]["KVSERVE_PORT"]
        old = f"{name}:{compose_port}"
        assert old in servers, (old, servers)
        servers = servers.replace(old, f"127.0.0.1:{port}")
    http_servers = env["KVSERVE_LB_HTTP_SERVERS"]
    for name, port in http_ports.items():
        old = f"{name}:{compose['services'][name]['environment']['KVSERVE_HTTP_PORT']}"
        assert old in http_servers, (old, http_servers)
        http_servers = http_servers.replace(old, f"127.0.0.1:{port}")
    env.update(KVSERVE_LB_SERVERS=servers, KVSERVE_LB_LISTEN=f"127.0.0.1:{lb_port}",
               KVSERVE_LB_STATUS_LISTEN=f"127.0.0.1:{status_port}",
               KVSERVE_LB_HTTP_SERVERS=http_servers,
               KVSERVE_LB_HTTP_LISTEN=f"127.0.0.1:{lb_http_port}")
    shutil.copy(NGINX_CONF, prefix / "nginx.conf")
    (prefix / "kvserve.conf").write_text(render_template(NGINX_TEMPLATE.read_text(), env))
    return prefix / "nginx.conf"


@pytest.fixture(scope="module")
def cluster(artifact, tmp_path_factory):
    compose = compose_yaml()
    names = ["server-1", "server-2"]
    work = tmp_path_factory.mktemp("deploy_cluster")
    with nginx_prefix_and_processes() as (prefix, procs):
        replicas = []
        ports = iter(free_ports(3 * len(names) + 3))  # three per server, three for nginx
        for name in names:
            port, mport, hport = next(ports), next(ports), next(ports)
            log = work / f"{name}.log"
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvserve.cli", "serve", str(artifact)],
                env=_server_env(compose, name, artifact, port, mport, work / f"{name}.json",
                                hport),
                stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=work)
            procs.append(proc)
            replicas.append(Replica(name, port, mport, proc, log, hport))
        for r in replicas:
            def up(r=r):
                if r.proc.poll() is not None:
                    raise RuntimeError(f"{r.name} exited:\n{r.log.read_text()}")
                info = read_json(work / f"{r.name}.json")
                return info is not None and info["port"] == r.port
            wait_until(up, 120, what=f"{r.name} to serve")
            assert read_json(work / f"{r.name}.json")["metrics_port"] == r.metrics_port

        lb_port, status_port, lb_http = next(ports), next(ports), next(ports)
        conf = _render_nginx(compose, prefix, {r.name: r.port for r in replicas}, lb_port,
                             status_port, {r.name: r.http_port for r in replicas}, lb_http)
        test = subprocess.run([NGINX, "-t", "-p", f"{prefix}/", "-c", str(conf)],
                              capture_output=True, text=True, timeout=30)
        assert test.returncode == 0, test.stderr
        nginx = subprocess.Popen([NGINX, "-p", f"{prefix}/", "-c", str(conf)],
                                 stdout=(prefix / "nginx.out").open("wb"),
                                 stderr=(prefix / "nginx.err").open("wb"))
        procs.append(nginx)
        c = Cluster(replicas, lb_port, status_port, nginx, prefix, lb_http)

        def lb_up():
            if nginx.poll() is not None:
                raise RuntimeError("nginx exited:\n" + c.nginx_log())
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{status_port}/healthz",
                                              timeout=2).read() == b"ok\n"
            except OSError:
                return False
        wait_until(lb_up, 20, what="nginx")
        yield c


@pytest.fixture(scope="module")
def channel(cluster):
    ch = grpc.insecure_channel(cluster.target)
    grpc.channel_ready_future(ch).result(timeout=10)
    yield ch
    ch.close()


def _score(stub, text="def add(a, b):\n    return a + b\n"):
    r = stub.Score(pb.ScoreRequest(texts=[text]), timeout=30)
    return r.sequences[0]


def _generate(stub, n=24):
    req = pb.GenerateRequest(text="def add(a, b):",
                             stopping=pb.StoppingOptions(max_new_tokens=n, ignore_eos=True))
    chunks, done = [], None
    for msg in stub.Generate(req, timeout=60):
        if msg.HasField("chunk"):
            chunks.append(msg.chunk)
        else:
            done = msg.complete
    assert done is not None and done.generated_tokens == n
    return [c.id for c in chunks], done


# --- tests ------------------------------------------------------------------------------------
def test_health_through_the_balancer(cluster, channel):
    h = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvserve.v1.Inference"):
        assert h.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
    # the image's HEALTHCHECK script: through the balancer, against each replica (target taken
    # from KVSERVE_PORT as in the container), and against nothing
    for target, env in [(cluster.target, {})] + [
            (None, {"KVSERVE_PORT": str(r.port)}) for r in cluster.replicas]:
        out = subprocess.run([sys.executable, str(HEALTHCHECK), *([target] if target else [])],
                             capture_output=True, text=True, timeout=30,
                             env={**os.environ, **env})
        assert out.returncode == 0 and "SERVING" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([sys.executable, str(HEALTHCHECK), f"127.0.0.1:{free_port()}",
                          "--timeout", "1"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "unhealthy" in out.stderr


def test_http_api_through_the_balancer(cluster):
    """GET /health and the OpenAI-compatible API through nginx's HTTP listener: a streamed
    completion (server-sent events, unbuffered) equals the same request to a replica directly,
    and requests are spread over both replicas."""
    import json

    openai = pytest.importorskip("openai")
    lb = f"http://127.0.0.1:{cluster.http_port}"
    assert json.load(urllib.request.urlopen(lb + "/health", timeout=10))["status"] == "ok"
    kw = dict(model="kvserve", prompt="def add(a, b):", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    with openai.OpenAI(base_url=lb + "/v1", api_key="-", max_retries=0) as c, \
            openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.replicas[0].http_port}/v1",
                          api_key="-", max_retries=0) as d:
        assert [m.id for m in c.models.list().data] == ["kvserve"]
        direct = d.completions.create(**kw).choices[0].text
        before = [r.count("Generate", "length") for r in cluster.replicas]
        for _ in range(6):
            text = "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True))
            assert text == direct
        served = [r.count("Generate", "length") - b for r, b in zip(cluster.replicas, before)]
    assert sum(served) == 6 and all(s >= 1 for s in served), served
    r = cluster.replicas[0]
    out = subprocess.run([sys.executable, str(HEALTHCHECK), r.target, "--http-port",
                          str(r.http_port)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "/health: ok" in out.stdout, out.stdout + out.stderr


def test_unary_calls_on_one_channel_reach_every_replica(cluster, channel):
    stub = pb_grpc.InferenceStub(channel)
    before = [r.count("Score") for r in cluster.replicas]
    n = 40
    results = [_score(stub) for _ in range(n)]
    after = [r.count("Score") for r in cluster.replicas]
    served = [a - b for a, b in zip(after, before)]
    assert sum(served) == n, served
    # per-request balancing: both replicas got a fair share of the one channel's calls
    assert all(s >= n // 4 for s in served), served
    # both replicas serve the same artifact: the same scores whoever answered
    assert len({round(r.sum_logprob, 4) for r in results}) == 1
    log = cluster.nginx_log()
    for r in cluster.replicas:
        assert f"upstream={r.target}" in log, f"no call went to {r.name} in nginx's log"


def test_streaming_generate_through_the_balancer_equals_direct(cluster, channel):
    direct = grpc.insecure_channel(cluster.replicas[0].target)
    try:
        want, _ = _generate(pb_grpc.InferenceStub(direct))
    finally:
        direct.close()
    stub = pb_grpc.InferenceStub(channel)
    before = [r.count("Generate", "length") for r in cluster.replicas]
    for _ in range(4):  # round robin: both replicas stream some of them
        got, done = _generate(stub)
        assert got == want
        assert done.finish_reason == pb.FINISH_REASON_LENGTH
    served = [r.count("Generate", "length") - b for r, b in zip(cluster.replicas, before)]
    assert sum(served) == 4 and all(served), served


def test_a_killed_replica_is_routed_around(cluster, channel):
    stub = pb_grpc.InferenceStub(channel)
    _score(stub)  # the channel is warm and has used both replicas (tests above, or now)
    dead, alive = cluster.replicas
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait(10)
    before = alive.count("Score")
    n = 20
    for _ in range(n):
        _score(stub)  # every call succeeds, on the same channel
    assert alive.count("Score") - before == n
    # not luck: nginx tried the dead replica, got the connection refused and passed the call on
    # (grpc_next_upstream error), which its log shows as "upstream=DEAD, ALIVE"
    assert f"upstream={dead.target}, {alive.target}" in cluster.nginx_log()
    got, _ = _generate(stub, 8)
    assert len(got) == 8
    # with no replica left the caller hears UNAVAILABLE (HTTP 502 from nginx), quickly
    alive.proc.send_signal(signal.SIGKILL)
    alive.proc.wait(10)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        _score(stub)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 10
    assert cluster.nginx.poll() is None


def test_build_model_script_is_idempotent(artifact, tmp_path):
    """The model-builder's entry point with an artifact that verifies: `kvserve verify` (real)
    passes, nothing is trained, imported or exported."""
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
           "KVSERVE_MODEL_DIR": str(artifact), "KVSERVE_RUN_DIR": str(tmp_path / "run"),
           "KVSERVE_HF_DIR": str(tmp_path / "hf")}
    before = {p.name: p.stat().st_mtime_ns for p in artifact.iterdir()}
    out = subprocess.run(["bash", str(BUILD_MODEL)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nothing to do" in out.stderr
    assert not (tmp_path / "run").exists()
    assert {p.name: p.stat().st_mtime_ns for p in artifact.iterdir()} == before

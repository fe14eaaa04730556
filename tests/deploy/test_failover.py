"""Streams survive a replica's death (docs/failover.md): a real nginx with the repository's
config in front of two real `kvserve serve` replicas (the compose file's KVSERVE_* settings;
decode steps slowed so that the streams are in flight when a replica goes), 16 concurrent
streams of the Python client (8 greedy, 8 seeded with temperature 0.9), one replica killed
(SIGKILL) or drained (SIGTERM, 1 s grace) once every stream has 20 tokens: all 16 complete,
each token-identical to the undisturbed run, every index once and in order, and the streams
that were cut were resumed (the client's attempts show it).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deploy_helpers import (NGINX_CONF, NGINX_TEMPLATE, REPO, compose_yaml, find_nginx,
                            free_ports, nginx_prefix_and_processes, read_json, render_template,
                            wait_until)

pytest.importorskip("torch")  # the test artifact is exported from a torch model
grpc = pytest.importorskip("grpc")
NGINX = find_nginx()
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (.ci/run installs "
                                                      "it with apt-get install -y nginx)")

from kvserve.clients import Client, TokenEvent  # noqa: E402

SLOW_SERVE = REPO / "tests" / "hardening" / "slow_serve.py"  # `kvserve serve`, slowed steps
STEP_DELAY = "0.02"  # seconds per decode step: 120 tokens outlast the kill on any machine
N_STREAMS, N_TOKENS, CUT_AFTER = 16, 120, 20
NAMES = ("server-1", "server-2")


@dataclass
class Replica:
    name: str
    port: int
    proc: subprocess.Popen
    log: Path


@dataclass
class Cluster:
    replicas: list[Replica]
    lb_port: int
    nginx: subprocess.Popen
    prefix: Path
    procs: list = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.lb_port}"


def _env(compose: dict, name: str, artifact: Path, port: int, port_file: Path) -> dict:
    env = {k: str(v) for k, v in compose["services"][name]["environment"].items()}
    env.update(KVSERVE_MODEL_DIR=str(artifact), KVSERVE_HOST="127.0.0.1",
               KVSERVE_PORT=str(port), KVSERVE_METRICS_PORT="-1", KVSERVE_HTTP_PORT="-1",
               KVSERVE_PORT_FILE=str(port_file), KVSERVE_DRAIN_GRACE="1",
               # all 16 streams fit one replica's batch after the other is gone
               KVSERVE_MAX_BATCH=str(N_STREAMS), KVSERVE_THREADS="1",
               KVSERVE_LOG_LEVEL="WARNING")
    return {**os.environ, "OMP_NUM_THREADS": "1", **env}


def _nginx_conf(compose: dict, prefix: Path, ports: dict[str, int], lb_ports: list[int]) -> Path:
    """deploy/nginx/nginx.conf and the compose nginx service's template values, with the
    replicas' addresses replaced by the loopback ones (the HTTP listener points nowhere)."""
    env = {k: str(v) for k, v in compose["services"]["nginx"]["environment"].items()}
    servers = env["KVSERVE_LB_SERVERS"]
    for name, port in ports.items():
        old = f"{name}:{compose['services'][name]['environment']['KVSERVE_PORT']}"
        assert old in servers, (old, servers)
        servers = servers.replace(old, f"127.0.0.1:{port}")
    lb, status, http_server, http = lb_ports
    env.update(KVSERVE_LB_SERVERS=servers, KVSERVE_LB_LISTEN=f"127.0.0.1:{lb}",
               KVSERVE_LB_STATUS_LISTEN=f"127.0.0.1:{status}",
               KVSERVE_LB_HTTP_SERVERS=f"server 127.0.0.1:{http_server};",
               KVSERVE_LB_HTTP_LISTEN=f"127.0.0.1:{http}")
    shutil.copy(NGINX_CONF, prefix / "nginx.conf")
    (prefix / "kvserve.conf").write_text(render_template(NGINX_TEMPLATE.read_text(), env))
    return prefix / "nginx.conf"


@pytest.fixture
def cluster(artifact, tmp_path):
    """Two fresh replicas and nginx (each test kills or drains one)."""
    compose = compose_yaml()
    with nginx_prefix_and_processes() as (prefix, procs):
        replicas = []
        ports = free_ports(len(NAMES) + 4)  # a gRPC port per replica, four for nginx
        for name, port in zip(NAMES, ports):
            log = tmp_path / f"{name}.log"
            proc = subprocess.Popen(
                [sys.executable, str(SLOW_SERVE), STEP_DELAY, "serve", str(artifact.dir)],
                env=_env(compose, name, artifact.dir, port, tmp_path / f"{name}.json"),
                stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=tmp_path)
            procs.append(proc)
            replicas.append(Replica(name, port, proc, log))
        for r in replicas:
            def up(r=r):
                if r.proc.poll() is not None:
                    raise RuntimeError(f"{r.name} exited:\n{r.log.read_text()}")
                info = read_json(tmp_path / f"{r.name}.json")
                return info is not None and info["port"] == r.port
            wait_until(up, 120, what=f"{r.name} to serve")
        lb_port = ports[len(NAMES)]
        conf = _nginx_conf(compose, prefix, {r.name: r.port for r in replicas},
                           ports[len(NAMES):])
        nginx = subprocess.Popen([NGINX, "-p", f"{prefix}/", "-c", str(conf)],
                                 stdout=(prefix / "nginx.out").open("wb"),
                                 stderr=(prefix / "nginx.err").open("wb"))
        procs.append(nginx)
        c = Cluster(replicas, lb_port, nginx, prefix)
        with Client(c.target, timeout=10) as probe:  # through nginx, to a replica
            wait_until(lambda: _reachable(probe), 20, what="nginx")
        yield c


def _reachable(client: Client) -> bool:
    try:
        client.model_info()
        return True
    except Exception:  # noqa: BLE001 - not yet
        return False


def _options(i: int) -> dict:
    """Stream i: 8 greedy, 8 seeded with temperature 0.9, each its own prompt."""
    kw = dict(max_new_tokens=N_TOKENS, ignore_eos=True)
    if i % 2:
        kw.update(temperature=0.9, seed=1000 + i)
    return kw


@dataclass
class Stream:
    i: int
    indices: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    attempts: int = 0
    complete: object = None
    error: BaseException | None = None


def _run(target: str, cut: threading.Event | None = None
         ) -> tuple[list[Stream], list[threading.Thread]]:
    """The 16 streams at once, each on its own client (its own attempts counted); with
    ``cut``: each stream pauses after CUT_AFTER tokens until the test has disturbed the
    cluster (every stream reached it first)."""
    streams = [Stream(i) for i in range(N_STREAMS)]
    reached = threading.Barrier(N_STREAMS + 1)

    def work(s: Stream):
        def count(method, attempt):
            s.attempts += method == "Generate"
        try:
            with Client(target, timeout=120, on_attempt=count) as c:
                for ev in c.generate_stream(f"def f{s.i}(x):", **_options(s.i)):
                    if not isinstance(ev, TokenEvent):
                        s.complete = ev
                        continue
                    s.indices.append(ev.index)
                    s.ids.append(ev.id)
                    if cut is not None and len(s.ids) == CUT_AFTER:
                        reached.wait(60)
                        cut.wait(60)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            s.error = e
            if cut is not None and len(s.ids) < CUT_AFTER:
                reached.abort()

    threads = [threading.Thread(target=work, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    if cut is not None:
        reached.wait(120)  # every stream has CUT_AFTER tokens (and is held there)
    return streams, threads


def _disturbed(cluster: Cluster, disturb) -> tuple[list[Stream], list[Stream]]:
    undisturbed, threads = _run(cluster.target)
    for t in threads:
        t.join(120)
    cut = threading.Event()
    streams, threads = _run(cluster.target, cut)
    disturb(cluster.replicas[0])
    cut.set()
    for t in threads:
        t.join(180)
    return undisturbed, streams


def _check(undisturbed: list[Stream], streams: list[Stream]) -> int:
    for s in undisturbed:
        assert s.error is None and s.complete is not None, (s.i, s.error)
        assert s.indices == list(range(N_TOKENS))
    for s, ref in zip(streams, undisturbed):
        assert s.error is None, (s.i, s.error)
        assert s.indices == list(range(N_TOKENS)), s.i  # every index once, in order
        assert s.ids == ref.ids, s.i  # token-identical to the undisturbed run
        assert s.complete.generated_tokens == N_TOKENS and s.complete.text == ref.complete.text
    return sum(s.attempts > 1 for s in streams)


def test_sigkill_of_a_replica_under_16_streams(cluster):
    def kill(r: Replica):
        r.proc.send_signal(signal.SIGKILL)
        r.proc.wait(10)

    undisturbed, streams = _disturbed(cluster, kill)
    resumed = _check(undisturbed, streams)
    # nginx balances per call: about half the streams were on the killed replica (8 of 16 in
    # every run seen, one resume each; without resuming they fail with INTERNAL: Stream
    # removed, the symptom)
    assert resumed >= 4, [s.attempts for s in streams]


def test_sigterm_with_a_short_grace_moves_the_streams(cluster):
    def term(r: Replica):
        r.proc.send_signal(signal.SIGTERM)

    undisturbed, streams = _disturbed(cluster, term)
    resumed = _check(undisturbed, streams)
    assert resumed >= 4, [s.attempts for s in streams]
    assert cluster.replicas[0].proc.wait(30) == 0  # the drained replica exited cleanly

"""The compose deployment, run for real on a Docker engine: the images built (from local Debian
bases: docker/base-images.sh), `docker compose up` of docker-compose.yml with the loopback
override tests/deploy/compose.e2e.yml (the model-builder trains and exports a tiny model into
the volume, two server replicas behind nginx, every health check), a gRPC Generate and an
OpenAI completion streamed through nginx, the hardening checked on the running containers, one
replica killed and the service still answering through the other, and `docker compose down -v`
leaving no container, volume or network behind.

Skips (saying why) where no Docker engine answers; .ci/run installs docker.io and starts
dockerd. The tests run in file order on one stack (module fixture)."""
from __future__ import annotations

import os
import re
import time
import urllib.request

import pytest

from deploy_helpers import COMPOSE_FILE, REPO, free_ports
from docker_helpers import (IMAGE_TAG, NGINX_BASE, PYTHON_BASE, UID, build_images,
                            engine_or_skip, health, inspect, proc_status, run, wait_healthy)

pytestmark = pytest.mark.slow

OVERRIDE = REPO / "tests" / "deploy" / "compose.e2e.yml"
PROJECT = f"kvserve-e2e-{os.getpid()}"  # concurrent runs on one engine do not collide
SERVERS = ("server-1", "server-2")
UP_TIMEOUT = 900  # model-builder (train + export the tiny model) + load and warm-up
PROMPT = "def fib(n):"


class Stack:
    def __init__(self, docker: str, compose: list[str]):
        self.docker = docker
        names = ["S1_GRPC", "S1_HTTP", "S1_METRICS", "S2_GRPC", "S2_HTTP", "S2_METRICS",
                 "LB_GRPC", "LB_STATUS", "LB_HTTP"]
        self.ports = dict(zip(names, free_ports(len(names))))
        self.env = {**os.environ, **{f"E2E_{n}": str(p) for n, p in self.ports.items()},
                    "KVSERVE_PYTHON_IMAGE": PYTHON_BASE, "KVSERVE_NGINX_IMAGE": NGINX_BASE,
                    "KVSERVE_IMAGE_TAG": IMAGE_TAG,
                    "DOCKER_HOST": os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")}
        self.compose = [*compose, "-p", PROJECT, "-f", str(COMPOSE_FILE), "-f", str(OVERRIDE)]
        self.took: dict[str, float] = {}

    def __call__(self, *args: str, timeout: float = 300, check: bool = True):
        return run([*self.compose, *args], timeout=timeout, check=check, cwd=REPO, env=self.env)

    def container(self, service: str) -> str:
        ids = self("ps", "-a", "-q", service).stdout.split()
        assert len(ids) == 1, (service, ids)
        return ids[0]

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={PROJECT}"
        return {kind: run([self.docker, *cmd, "--filter", label]).stdout.split()
                for kind, cmd in (("containers", ["ps", "-a", "-q"]),
                                  ("volumes", ["volume", "ls", "-q"]),
                                  ("networks", ["network", "ls", "-q"]))}


@pytest.fixture(scope="module")
def stack():
    docker, compose = engine_or_skip()
    s = Stack(docker, compose)
    s.took.update(build_images(docker))
    t0 = time.monotonic()
    try:
        try:
            s("up", "-d", "--no-build", timeout=UP_TIMEOUT)
            wait_healthy(docker, s.container("nginx"), timeout=120)
        except AssertionError as e:  # say which service failed, with its own words
            logs = s("logs", "--tail", "20", check=False)
            raise AssertionError(f"{e}\n--- compose logs ---\n{logs.stdout[-6000:]}") from None
        s.took["up"] = time.monotonic() - t0
        print(f"\ncompose e2e: seconds {({k: round(v, 1) for k, v in s.took.items()})}")
        yield s
    finally:
        if os.environ.get("KVSERVE_E2E_KEEP") != "1":
            s("down", "-v", "--remove-orphans", "--timeout", "10", check=False, timeout=300)


def grpc_stream(s: Stack, n_tokens: int = 8) -> tuple[list[str], object]:
    from kvserve.clients.client import NO_RETRY, Client, Completion

    pieces, done = [], None
    with Client(f"127.0.0.1:{s.ports['LB_GRPC']}", retry=NO_RETRY, timeout=60) as c:
        for ev in c.generate_stream(PROMPT, max_new_tokens=n_tokens,
                                     ignore_eos=True):
            if isinstance(ev, Completion):
                done = ev
            else:
                pieces.append(ev.text)
    return pieces, done


def openai_stream(s: Stack, n_tokens: int = 8) -> tuple[list[str], str | None]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.ports['LB_HTTP']}/v1",
                           api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    pieces, finish = [], None
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=n_tokens,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return pieces, finish


def served_by(s: Stack) -> dict[str, int]:
    """Finished Generate and /v1/completions requests per replica, from each one's Prometheus
    metrics (-1: the replica does not answer)."""
    out = {}
    for i, name in enumerate(SERVERS, 1):
        url = f"http://127.0.0.1:{s.ports[f'S{i}_METRICS']}/metrics"
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            out[name] = -1  # not answering (killed)
            continue
        out[name] = int(sum(float(v) for v in re.findall(
            r'^kvserve_requests_total\{[^}]*rpc="(?:Generate|http /v1/completions)"[^}]*\} '
            r'(\S+)', text, re.M)))
    return out


def test_every_service_is_up_and_healthy(stack):
    assert stack.leftovers()["containers"], "no containers"
    builder = inspect(stack.docker, stack.container("model-builder"))
    assert builder["State"]["Status"] == "exited" and builder["State"]["ExitCode"] == 0
    log = stack("logs", "--no-log-prefix", "model-builder").stdout
    assert "training the default model into /runs/default" in log, log[-2000:]
    assert "artifact ready at /models/current" in log, log[-2000:]
    for name in (*SERVERS, "nginx"):
        assert health(stack.docker, stack.container(name)) == "running/healthy", name


def test_generate_streams_through_nginx(stack):
    pieces, done = grpc_stream(stack)
    assert len(pieces) == 8 and done is not None and done.finish_reason == "length", (pieces,
                                                                                      done)
    assert done.generated_tokens == 8


def test_openai_completion_streams_through_nginx(stack):
    pieces, finish = openai_stream(stack)
    assert len([p for p in pieces if p]) >= 1 and finish == "length", (pieces, finish)


def test_calls_are_spread_over_both_replicas(stack):
    before = served_by(stack)
    for _ in range(4):
        grpc_stream(stack, 2)
    after = served_by(stack)
    assert all(after[n] > before[n] for n in SERVERS), (before, after)


def test_hardening_of_the_running_containers(stack):
    for name in (*SERVERS, "model-builder"):
        hc = inspect(stack.docker, stack.container(name))["HostConfig"]
        cfg = inspect(stack.docker, stack.container(name))["Config"]
        assert cfg["User"] == f"{UID}:{UID}", name
        assert hc["ReadonlyRootfs"] is True and "/tmp" in (hc["Tmpfs"] or {}), name
        assert hc["CapDrop"] == ["ALL"] and not hc["CapAdd"], name
        assert "no-new-privileges:true" in hc["SecurityOpt"], name
    for name in SERVERS:
        c = stack.container(name)
        procs = proc_status(stack.docker, c)
        server = [p for cmd, p in procs.items() if "bin/kvserve serve" in cmd]
        assert len(server) == 1, list(procs)
        for cmd, p in procs.items():  # docker-init (pid 1), the server, this probe's tools
            assert p["Uid"].split() == [str(UID)] * 4, (cmd, p["Uid"])
            assert int(p["CapEff"], 16) == 0 and int(p["CapPrm"], 16) == 0, (cmd, p)
            assert int(p["CapBnd"], 16) == 0 and p["NoNewPrivs"] == "1", (cmd, p)
        ro = run([stack.docker, "exec", c, "sh", "-c", "touch /usr/local/x"], check=False)
        assert ro.returncode != 0 and "Read-only file system" in ro.stderr, ro
        run([stack.docker, "exec", c, "sh", "-c", "touch /tmp/x && rm /tmp/x"])
        models = run([stack.docker, "exec", c, "sh", "-c", "touch /models/current/x"],
                     check=False)
        assert models.returncode != 0 and "Read-only file system" in models.stderr, models
    # nginx: the master keeps only what handing workers to an unprivileged user takes
    nginx = stack.container("nginx")
    hc = inspect(stack.docker, nginx)["HostConfig"]
    assert hc["CapDrop"] == ["ALL"] and "no-new-privileges:true" in hc["SecurityOpt"]
    assert sorted(c.removeprefix("CAP_") for c in hc["CapAdd"]) == ["CHOWN", "SETGID", "SETUID"]
    allowed = (1 << 0) | (1 << 6) | (1 << 7)  # CAP_CHOWN, CAP_SETGID, CAP_SETUID
    procs = proc_status(stack.docker, nginx)
    workers = [p for cmd, p in procs.items() if "nginx: worker process" in cmd]
    assert workers and len([c for c in procs if "nginx: master process" in c]) == 1, list(procs)
    for p in workers:
        assert p["Uid"].split()[0] != "0" and int(p["CapEff"], 16) == 0, p
    for cmd, p in procs.items():
        assert int(p["CapBnd"], 16) & ~allowed == 0 and p["NoNewPrivs"] == "1", (cmd, p)


def test_a_killed_replica_leaves_the_service_answering(stack):
    victim = stack.container("server-1")
    run([stack.docker, "kill", victim])
    assert not inspect(stack.docker, victim)["State"]["Running"]
    before = served_by(stack)
    assert before["server-1"] == -1
    for _ in range(3):  # no client retries (NO_RETRY): nginx sends each call to server-2
        pieces, done = grpc_stream(stack, 4)
        assert len(pieces) == 4 and done.finish_reason == "length"
        pieces, finish = openai_stream(stack, 4)
        assert finish == "length"
    after = served_by(stack)
    assert after["server-2"] - before["server-2"] >= 6, (before, after)


def test_compose_down_leaves_nothing_behind(stack):
    t0 = time.monotonic()
    stack("down", "-v", "--remove-orphans", "--timeout", "10", timeout=300)
    stack.took["down"] = time.monotonic() - t0
    assert stack.leftovers() == {"containers": [], "volumes": [], "networks": []}
    print(f"\ncompose e2e: seconds {({k: round(v, 1) for k, v in stack.took.items()})}")

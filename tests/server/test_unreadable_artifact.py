"""A server that cannot read an artifact file says so in one line, naming the file and the
user it runs as (the case of a host export mounted into a container that runs as another uid;
tests/deploy/test_docker_e2e.py runs that one for real). The file here is mode 000; as root the
server runs without the capabilities that let root read any file (setpriv)."""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys

import pytest


def _prefix() -> list[str]:
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_unreadable_file_is_one_line_naming_file_and_user(artifact, tmp_path, verify):
    root = tmp_path / "art"
    shutil.copytree(artifact.dir, root)
    data = next(root.glob("*.onnx.data"))
    data.chmod(0o000)
    uid = os.geteuid()
    r = subprocess.run([*_prefix(), sys.executable, "-m", "kvserve.cli", "serve", str(root),
                        "--port", "0", "--metrics-port", "0",
                        "--verify" if verify else "--no-verify"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"kvserve serve: refusing to serve {root}: cannot read artifact file {data} as user "
        f"{pwd.getpwuid(uid).pw_name} (uid {uid}); make the artifact's files readable by it "
        f"(chmod a+r)")

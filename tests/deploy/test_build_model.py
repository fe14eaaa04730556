"""docker/build-model.sh (the compose model-builder's entry point): which work it does in which
state, with a stand-in `kvserve` on PATH that records its calls (the real `kvserve verify` on a
real artifact is in test_nginx_lb.py)."""
from __future__ import annotations

import os
import subprocess

import pytest

from deploy_helpers import REPO

SCRIPT = REPO / "docker" / "build-model.sh"

FAKE_KVSERVE = r"""#!/usr/bin/env bash
# records every call; `verify DIR` passes when DIR/ok exists; FAIL_EXPORT=1 makes export fail
echo "$*" >> "$CALLS"
cmd=$1; shift
out=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    [[ "${args[i]}" == --out ]] && out=${args[i+1]}
done
case $cmd in
    verify) [[ -f "$1/ok" ]] ;;
    train) mkdir -p "$out" && touch "$out/train_state.json" ;;
    import-hf) mkdir -p "$out" ;;
    export) [[ "${FAIL_EXPORT:-0}" != 1 ]] && mkdir -p "$out" && touch "$out/manifest.json" "$out/ok" ;;
    *) exit 9 ;;
esac
"""


@pytest.fixture
def run(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "kvserve"
    fake.write_text(FAKE_KVSERVE)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    base = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "CALLS": str(calls),
            "KVSERVE_MODEL_DIR": str(tmp_path / "models" / "current"),
            "KVSERVE_RUN_DIR": str(tmp_path / "runs" / "default"),
            "KVSERVE_HF_DIR": str(tmp_path / "hf")}
    (tmp_path / "models").mkdir()

    def go(**env) -> tuple[int, list[str], str]:
        calls.write_text("")
        out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30,
                             env={**os.environ, **base, **env})
        return out.returncode, calls.read_text().splitlines(), out.stderr

    go.tmp = tmp_path
    return go


def test_trains_exports_verifies_then_swaps_and_is_idempotent(run):
    t = run.tmp
    rc, calls, err = run(KVSERVE_TRAIN_ARGS="--preset tiny --max-minutes 1",
                         KVSERVE_EXPORT_ARGS="--precision int8")
    assert rc == 0, err
    run_dir, staging = t / "runs" / "default", t / "models" / ".staging-current"
    assert calls == [f"train --out {run_dir} --preset tiny --max-minutes 1",
                     f"export {run_dir} --out {staging} --overwrite --precision int8",
                     f"verify {staging}"]
    assert (t / "models" / "current" / "ok").is_file()
    assert sorted(p.name for p in (t / "models").iterdir()) == ["current"]
    # second start: the artifact verifies, nothing else runs
    rc, calls, err = run()
    assert rc == 0 and calls == [f"verify {t / 'models' / 'current'}"]
    assert "nothing to do" in err
    # forced: exported again (training resumes, which stops at once for a finished run)
    rc, calls, _ = run(KVSERVE_FORCE_REBUILD="1")
    assert rc == 0 and calls[0] == f"train --resume --out {run_dir}"


def test_imports_a_mounted_hugging_face_directory(run):
    hf = run.tmp / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    rc, calls, err = run()
    assert rc == 0, err
    assert calls[0] == f"import-hf {hf} --out {run.tmp / 'runs' / 'default'} --overwrite"
    assert calls[1].startswith("export ")


def test_a_failed_export_leaves_the_served_artifact_alone(run):
    current = run.tmp / "models" / "current"
    current.mkdir()
    (current / "old-model").write_text("x")  # does not verify (no ok), but is what servers have
    rc, calls, _ = run(FAIL_EXPORT="1")
    assert rc != 0
    assert calls[-1].startswith("export ")
    assert (current / "old-model").is_file()

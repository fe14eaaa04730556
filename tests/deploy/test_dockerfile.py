"""docker/Dockerfile, parsed: the stages exist, it builds without Docker Hub (no `# syntax`
pull, the base a build argument), the server stage never installs torch, the model-builder gets
the CPU torch from the PyTorch CPU index (a build argument), both run as a non-root user, every
COPY source exists and is inside the build context that .dockerignore leaves; and that context,
copied out, really builds the wheel with the generated gRPC stubs (the wheel stage's command)."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deploy_helpers import DOCKERFILE, REPO

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass
class Instruction:
    cmd: str
    args: str
    line: int


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, cmd: str) -> list[Instruction]:
        return [i for i in self.instructions if i.cmd == cmd]


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Dockerfile syntax as BuildKit reads it: comment lines dropped (also inside a continued
    instruction), backslash continuation, global ARGs before the first FROM substituted into
    FROM."""
    instructions: list[Instruction] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        cmd, _, args = buf.partition(" ")
        instructions.append(Instruction(cmd.upper(), args.strip(), start))
        buf = ""
    assert not buf, "dangling line continuation at the end"
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for ins in instructions:
        if ins.cmd == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", ins.args, re.I)
            assert m, ins
            base = re.sub(r"\$\{?(\w+)\}?", lambda v: global_args[v.group(1)], m.group(1))
            current = Stage(m.group(2) or str(len(stages)), base)
            stages[current.name] = current
        elif current is None:
            assert ins.cmd == "ARG", f"line {ins.line}: {ins.cmd} before FROM"
            k, _, v = ins.args.partition("=")
            global_args[k] = v
        else:
            current.instructions.append(ins)
    return global_args, stages


# --- .dockerignore (moby/patternmatcher semantics) ----------------------------------------------
def _pattern_regex(p: str) -> re.Pattern:
    out, i = "", 0
    while i < len(p):
        if p.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif p.startswith("**", i):
            out, i = out + ".*", i + 2
        elif p[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif p[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(p[i]), i + 1
    return re.compile(out)


def dockerignore(path: Path) -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = line[1:].strip() if negate else line
        pat = str(Path(pat.lstrip("/"))).replace("\\", "/")  # filepath.Clean
        rules.append((negate, _pattern_regex(pat)))
    return rules


def excluded(rel: str, rules) -> bool:
    parts = rel.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    matched = False
    for negate, rx in rules:
        if any(rx.fullmatch(c) for c in candidates):
            matched = not negate
    return matched


def context_files(rules) -> list[str]:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    return sorted(f for f in files if (REPO / f).is_file() and not excluded(f, rules))


@pytest.fixture(scope="module")
def stages():
    return parse_dockerfile(DOCKERFILE.read_text())[1]


@pytest.fixture(scope="module")
def rules():
    return dockerignore(REPO / ".dockerignore")


def _copies(stage: Stage) -> list[tuple[list[str], str]]:
    out = []
    for ins in stage.all("COPY"):
        words = [w for w in shlex.split(ins.args) if not w.startswith("--")]
        if any(w.startswith("--from") for w in shlex.split(ins.args)):
            continue
        out.append((words[:-1], words[-1]))
    return out


def test_stages_and_bases(stages):
    assert {"wheel", "server", "model-builder"} <= set(stages)
    for name in ("server", "model-builder"):
        assert stages[name].base == "python:3.11-slim", name


def test_builds_without_docker_hub():
    """No `# syntax=` line (BuildKit would pull that frontend image from Docker Hub before
    building), every stage's base is the PYTHON_IMAGE build argument, and pip's build-machine
    sources come in as optional secrets on every pip command (never in a layer)."""
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    global_args, _ = parse_dockerfile(text)
    assert global_args == {"PYTHON_IMAGE": "python:3.11-slim"}
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms and set(froms) == {"${PYTHON_IMAGE}"}, froms
    runs = [c for c in re.split(r"\n(?=[A-Z]+ )", text) if re.search(r"\bpip (install|wheel)\b", c)]
    assert len(runs) == 5  # wheel; server and model-builder: dependencies, wheel
    for cmd in runs:
        assert "--mount=type=secret,id=pip.conf,target=/etc/pip.conf" in cmd, cmd
        assert "--mount=type=secret,id=pip-ca" in cmd, cmd


def _pip_installs(stage: Stage) -> list[str]:
    cmds = [c.strip() for i in stage.all("RUN") for c in re.split(r"&&|;|\|\|", i.args)]
    cmds = [re.sub(r"^(--mount=\S+\s+)+", "", c) for c in cmds]  # RUN flags
    return [" ".join(c.split()) for c in cmds if re.search(r"\bpip\s+install\b", c)]


def test_server_stage_never_installs_torch(stages):
    server = stages["server"]
    installs = _pip_installs(server)
    # the base dependencies (their own layer), then the wheel's base install
    assert installs == ["pip install -r /tmp/requirements.txt",
                        "pip install /wheels/kvserve-*.whl"], installs
    reqs = " ".join(i.args for i in server.all("RUN") if "requirements.py" in i.args)
    assert "requirements.py /tmp/req/pyproject.toml > /tmp/requirements.txt" in reqs
    for i in server.instructions:
        if i.cmd in ("ENV", "ARG"):
            assert "pytorch" not in i.args.lower() and "PIP_" + "EXTRA" not in i.args, i
    text = " ".join(i.args for i in server.instructions)
    assert "[train]" not in text and "download.pytorch.org" not in text
    # and it proves it at build time
    assert "find_spec('torch')" in " ".join(i.args for i in server.all("RUN"))


def test_model_builder_gets_cpu_torch_from_the_pytorch_index(stages):
    deps, install = _pip_installs(stages["model-builder"])
    # the index is a build argument (empty: the build's own pip sources hold the CPU wheel)
    assert [a.args for a in stages["model-builder"].all("ARG")] == [
        f"TORCH_INDEX={TORCH_CPU_INDEX}"]
    for cmd in (deps, install):
        assert '${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}' in cmd, cmd
    assert deps.endswith("-r /tmp/requirements.txt") and "[train]" in install
    reqs = " ".join(i.args for i in stages["model-builder"].all("RUN")
                    if "requirements.py" in i.args)
    assert "requirements.py /tmp/req/pyproject.toml train > /tmp/requirements.txt" in reqs
    # the index is named in the Dockerfile only: the project's own install stays as it is
    for f in ("pyproject.toml", "setup.py", "scripts/install.sh", "scripts/test.sh", ".ci/run"):
        assert "download.pytorch.org" not in (REPO / f).read_text(), f


def test_runtime_stages_run_as_non_root(stages):
    for name in ("server", "model-builder"):
        users = stages[name].all("USER")
        assert users, name
        user = users[-1].args.split(":")[0]
        assert user not in ("root", "0"), name
        assert "useradd" in " ".join(i.args for i in stages[name].all("RUN"))


def test_copy_sources_exist_and_are_in_the_context(stages, rules):
    for stage in stages.values():
        for sources, _dest in _copies(stage):
            for src in sources:
                p = REPO / src
                assert p.exists(), f"{stage.name}: COPY {src}: missing"
                inside = [f for f in context_files(rules) if f == src or f.startswith(
                    src.rstrip("/") + "/")]
                assert inside, f"{stage.name}: COPY {src}: excluded by .dockerignore"
        for ins in stage.all("RUN"):
            for m in re.finditer(r"--mount=\S*from=([\w-]+)", ins.args):
                assert m.group(1) in stages, f"{stage.name}: unknown stage {m.group(1)}"
            for m in re.finditer(r"--mount=(\S+)", ins.args):  # bind mounts of context files
                opts = dict(o.partition("=")[::2] for o in m.group(1).split(","))
                if opts.get("type") == "bind" and "from" not in opts:
                    assert opts["source"] in context_files(rules), \
                        f"{stage.name}: RUN --mount source {opts['source']} not in the context"


def test_requirements_script_lists_the_base_and_extra_dependencies():
    py = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    script = REPO / "docker" / "requirements.py"
    for extras, want in (([], py["dependencies"]),
                         (["train"], py["dependencies"] + py["optional-dependencies"]["train"])):
        out = subprocess.run([sys.executable, str(script), str(REPO / "pyproject.toml"), *extras],
                             capture_output=True, text=True, check=True, timeout=30)
        assert out.stdout.splitlines() == want
    assert not any("torch" in r for r in py["dependencies"])


def test_wheel_stage_copies_every_package(stages):
    py = tomllib.loads((REPO / "pyproject.toml").read_text())
    copied = {s.rstrip("/") for srcs, _ in _copies(stages["wheel"]) for s in srcs}
    needed = set(py["tool"]["setuptools"]["package-dir"].values())
    needed = {d.split("/")[0] for d in needed} | {"pyproject.toml", "setup.py", "protos",
                                                  "scripts/gen_protos.py", py["project"]["readme"]}
    assert needed <= copied, needed - copied


def test_entrypoints_and_healthcheck(stages):
    server = stages["server"]
    assert ("docker/healthcheck.py", "/usr/local/bin/kvserve-healthcheck") in \
        [(s[0], d) for s, d in _copies(server)]
    hc = server.all("HEALTHCHECK")
    assert hc and "kvserve-healthcheck" in hc[-1].args and "--start-period" in hc[-1].args
    assert "kvserve serve" in server.all("ENTRYPOINT")[-1].args
    builder = stages["model-builder"]
    assert ("docker/build-model.sh", "/usr/local/bin/kvserve-build-model") in \
        [(s[0], d) for s, d in _copies(builder)]


def test_context_leaves_out_tests_and_outputs(rules):
    files = context_files(rules)
    for f in files:
        assert not f.startswith(("tests/", "runs/", "artifacts/", ".git/", "deploy/")), f
        assert "__pycache__" not in f and not re.search(r"_pb2(_grpc)?\.pyi?$", f), f
    assert "pyproject.toml" in files and "docker/healthcheck.py" in files


def test_the_context_builds_the_wheel_with_stubs(tmp_path, rules):
    """The wheel stage's `pip wheel --no-deps .`, on exactly the files the build would see
    (offline here: the build requirements are the ones already installed)."""
    ctx = tmp_path / "context"
    for f in context_files(rules):
        dst = ctx / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes((REPO / f).read_bytes())
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-q", ".", "-w", str(tmp_path / "w")],
                         cwd=ctx, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    (whl,) = (tmp_path / "w").glob("kvserve-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for n in ("kvserve/v1/inference_pb2.py", "kvserve/v1/inference_pb2_grpc.py",
              "kvserve/server/main.py", "kvserve/artifact/verify.py",
              "kvserve/artifact/fused.py", "kvserve/model/hf/llama.py"):
        assert n in names, n
    entry = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("entry_points.txt")))
    assert b"kvserve = kvserve.cli:main" in entry

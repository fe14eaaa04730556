"""docker/build_images.py without an engine: the build machine's pip settings become the
build's pip.conf (local indexes and find-links folders served on loopback under their own
paths, so an index's relative links resolve; remote URLs kept), and the loopback server
serves those folders and nothing else."""
from __future__ import annotations

import http.server
import importlib.util
import urllib.error
import urllib.parse
import urllib.request

import pytest

from deploy_helpers import REPO

spec = importlib.util.spec_from_file_location("build_images", REPO / "docker" / "build_images.py")
build_images = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_images)


@pytest.fixture
def sources(tmp_path):
    (tmp_path / "idx" / "simple" / "pkg").mkdir(parents=True)
    (tmp_path / "idx" / "files").mkdir()
    (tmp_path / "idx" / "files" / "pkg-1.0-py3-none-any.whl").write_bytes(b"wheel")
    (tmp_path / "idx" / "simple" / "pkg" / "index.html").write_text(
        '<a href="../../files/pkg-1.0-py3-none-any.whl">pkg</a>')
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch-2.13.0+cpu-cp311-none-any.whl").write_bytes(b"torch")
    (tmp_path / "secret.txt").write_text("not served")
    return tmp_path


def test_pip_conf_for_the_build(sources):
    cfg = {"index-url": "https://pypi.org/simple",
           "extra-index-url": f"file://{sources}/idx/simple file://{sources}/missing",
           "find-links": str(sources / "wheels"), "default-timeout": "180",
           "cert": "/etc/ssl/certs/ca-certificates.crt", "constraint": "/etc/c.txt"}
    conf, roots = build_images.build_pip_conf(cfg, 4321)
    base = "http://127.0.0.1:4321"
    assert conf.splitlines() == [
        "[global]",
        "index-url = https://pypi.org/simple",
        f"extra-index-url = {base}{sources}/idx/simple/",
        f"find-links = {base}{sources}/wheels/",
        "trusted-host = 127.0.0.1",
        "default-timeout = 180"]
    assert roots == [sources / "idx", sources / "wheels"]  # an index: its parent


def test_loopback_server_serves_the_roots_only(sources):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), build_images._Handler)
    _conf, roots = build_images.build_pip_conf(
        {"extra-index-url": f"file://{sources}/idx/simple", "find-links": str(sources / "wheels")},
        server.server_address[1])
    build_images.serve(server, roots)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        page = urllib.request.urlopen(f"{base}{sources}/idx/simple/pkg/", timeout=10).read()
        link = urllib.parse.urljoin(f"{base}{sources}/idx/simple/pkg/",
                                    page.decode().split('"')[1])
        assert urllib.request.urlopen(link, timeout=10).read() == b"wheel"
        assert urllib.request.urlopen(
            f"{base}{sources}/wheels/torch-2.13.0%2Bcpu-cp311-none-any.whl", timeout=10
        ).read() == b"torch"
        for outside in (f"{sources}/secret.txt", "/etc/passwd", f"{sources}/idx/../secret.txt"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + outside, timeout=10)
            assert e.value.code == 404, outside
    finally:
        server.shutdown()

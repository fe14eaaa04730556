"""Shared fixtures. Tests mirror the modules: tests/model, tests/export, tests/server, ..."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
# Idle OpenMP threads sleep instead of spinning: on 2 shared cores spinning costs several x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True, scope="session")
def _torch_threads():
    try:
        import torch
    except ImportError:  # the server-only install has no torch
        yield
        return
    torch.set_num_threads(2)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def artifact(tmp_path_factory):
    """The tiny served artifact (random init, fixed seed) and its torch model: built once per
    session, shared by tests/server, tests/clients and tests/hardening."""
    pytest.importorskip("torch")
    from kvserve_testing import build_artifact

    return build_artifact(tmp_path_factory.mktemp("server_artifact"))


@pytest.fixture(scope="session")
def native_library() -> str:
    """kvserve's native library (``artifact.native_build``) for this checkout and machine: on
    CI a test that needs it fails without it (scripts/install.sh builds it), elsewhere skips."""
    from kvserve.artifact import native_build

    lib, why = native_build.library()
    if lib is None:
        if os.environ.get("CI"):
            pytest.fail(f"the native library is not built on CI: {why}")
        pytest.skip(why)
    return lib

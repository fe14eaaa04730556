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

"""Shared fixtures. Tests mirror the modules: tests/model, tests/export, tests/server, ..."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

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


def _server_conftest():
    """tests/server/conftest.py as a module of its own, for its build helpers."""
    name = "kvserve_tests_server_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parent / "server" / "conftest.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="session")
def artifact(tmp_path_factory):
    """The tiny served artifact (random init, fixed seed) and its torch model: built once per
    session by tests/server/conftest.py's build_artifact, shared by tests/server and
    tests/clients."""
    pytest.importorskip("torch")
    return _server_conftest().build_artifact(tmp_path_factory.mktemp("server_artifact"))

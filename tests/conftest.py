"""Shared fixtures. Tests mirror the modules: tests/model, tests/export, tests/server, ..."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")


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

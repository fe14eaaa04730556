"""Clients of the kvserve gRPC service: Python library (sync + asyncio), CLI, batch scoring.

The names below come from ``kvserve.clients.client`` on first use (PEP 562), so the CLI
modules of this package (``kvserve generate --help``) do not import grpc.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AsyncClient", "Client", "Completion", "GenerateEvent", "KvserveError", "ModelInfo",
           "RetryPolicy", "ScoredToken", "ScoreResult", "TokenEvent", "TopLogprob"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".client", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

"""What the bench scripts share: where results go and what machine they ran on. Imported by
``main``, ``profile`` and ``decode_cost``; imports none of them."""
from __future__ import annotations

import os
import platform
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"  # committed results: written only when asked for
README = REPO / "README.md"
CACHE = REPO / ".bench"  # built models and scratch results (git-ignored)


def loadavg() -> float:
    return os.getloadavg()[0]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()}"


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for p in ("onnxruntime", "onnxruntime-genai", "torch", "transformers", "numpy"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    return out

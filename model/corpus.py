"""The embedded default corpus: the Python standard library's own ``.py`` sources on this machine.

Found via ``sysconfig.get_paths()["stdlib"]``; site-packages, test suites, ``idlelib``-style
GUIs and generated tables are skipped; files are taken in sorted order until a byte cap is
reached, so the same machine always gives the same corpus.
"""
from __future__ import annotations

import logging
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 12_000_000
MAX_FILE_BYTES = 400_000  # skip huge generated files (e.g. big data tables)
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
             "lib2to3", "turtledemo", "idlelib", "ensurepip", "venv", "config-3"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None) -> list[Path]:
    """Sorted stdlib ``.py`` files whose sizes sum to at most ``max_bytes``."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"Python standard library not found at {root}")
    files: list[Path] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in SKIP_DIRS or p.startswith("config-") or p.startswith(".") for p in rel[:-1]):
            continue
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size == 0 or size > MAX_FILE_BYTES:
            continue
        if total + size > max_bytes:
            continue  # keep scanning: a smaller later file may still fit
        files.append(path)
        total += size
    if not files:
        raise FileNotFoundError(f"no Python sources found under {root}")
    log.info("default corpus: %d stdlib files, %.1f MB from %s", len(files), total / 1e6, root)
    return files

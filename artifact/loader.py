"""``load_lm``: the runner an artifact's manifest asks for (its ``runtime.kind``)."""
from __future__ import annotations

import json
from pathlib import Path

from .fused import FusedLM
from .manifest import MANIFEST
from .portable import PortableLM
from .spec import FUSED, PORTABLE


def artifact_kind(artifact_dir: str | Path) -> str:
    manifest = json.loads((Path(artifact_dir) / MANIFEST).read_text())
    runtime = manifest.get("runtime")
    # artifacts made before the fused graphs existed have no runtime entry: portable graphs
    return runtime.get("kind", PORTABLE) if isinstance(runtime, dict) else PORTABLE


def load_lm(artifact_dir: str | Path, **kw) -> FusedLM | PortableLM:
    """FusedLM or PortableLM for ``artifact_dir``; keywords as theirs (provider, threads,
    attention, spin, tf32, options, attention_copy; attention_kernel: fused only)."""
    kind = artifact_kind(artifact_dir)
    if kind == FUSED:
        return FusedLM(artifact_dir, **kw)
    if kind == PORTABLE:  # (standard ops: no attention kernel to choose)
        kw.pop("attention_kernel", None)
        return PortableLM(artifact_dir, **kw)
    raise ValueError(f"unknown artifact kind {kind!r}")

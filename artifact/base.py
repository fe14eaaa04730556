"""What every runner does first: read the artifact's config and manifest, choose providers."""
from __future__ import annotations

import json
from pathlib import Path

import onnxruntime as ort

from kvserve.model.config import ModelConfig

from .manifest import CONFIG, MANIFEST
from .providers import check_optimized_for, choose_providers, session_options


class ArtifactRunner:
    """Base of ``FusedLM`` and ``PortableLM``: ``dir``, ``cfg``, ``manifest``, ``providers``,
    and the session options their sessions share."""
    kind = "?"

    def __init__(self, artifact_dir: str | Path, provider: str = "auto",
                 threads: int | None = None, spin: bool = True, tf32: bool = False,
                 options: ort.SessionOptions | None = None):
        self.dir = Path(artifact_dir)
        self.cfg = ModelConfig.load(self.dir / CONFIG)
        self.manifest = json.loads((self.dir / MANIFEST).read_text())
        self.providers = choose_providers(provider, tf32)
        check_optimized_for(self.manifest, self.providers)
        self.options = options or session_options(threads, spin)
        self.ort_seconds = 0.0  # time inside onnxruntime's runs, all calls (profiling tools)

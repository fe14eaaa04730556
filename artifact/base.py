"""What every runner does first: read the artifact's config and manifest, choose providers."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvserve.model.config import ModelConfig

from .manifest import CONFIG, MANIFEST
from .providers import check_optimized_for, choose_providers, session_options
from .rows import LogSoftmax

CAPACITY_CHUNK = 128  # KV capacity grows and shrinks in whole chunks of rows
# Buffer generations are unique across every KV cache of the process, so a cached IO binding can
# never be taken for a different set of buffers (an ``id()`` is reused once its object is freed).
GENERATIONS = itertools.count(1)


def chunks(rows: int) -> int:
    """Rows rounded up to a whole number of capacity chunks (at least one)."""
    return CAPACITY_CHUNK * ((max(rows, 1) + CAPACITY_CHUNK - 1) // CAPACITY_CHUNK)


def nbits(manifest: dict) -> bool:
    """Whether the artifact's weight matmuls are ``MatMulNBits`` (int4; int8 in blocks)."""
    return manifest.get("precision") == "int4" or \
        (manifest.get("quantization") or {}).get("op") == "MatMulNBits"


class ArtifactRunner:
    """Base of ``FusedLM`` and ``PortableLM``: ``dir``, ``cfg``, ``manifest``, ``providers``,
    and the session options their sessions share."""
    kind = "?"

    def __init__(self, artifact_dir: str | Path, provider: str = "auto",
                 threads: int | None = None, spin: bool = True, tf32: bool = False,
                 options: ort.SessionOptions | None = None, attention_copy: bool = False):
        self.dir = Path(artifact_dir)
        self.cfg = ModelConfig.load(self.dir / CONFIG)
        self.manifest = json.loads((self.dir / MANIFEST).read_text())
        self.providers = choose_providers(provider, tf32)
        check_optimized_for(self.manifest, self.providers)
        self.options = options or session_options(threads, spin)
        # the diagnostics sessions' (attention weights, asked for now and then): their weights
        # stay in the artifact's memory-mapped data file, not a second copy in the process
        # (onnxruntime's Python API cannot share the packed weights of the main session), and
        # their matmuls pack per call (~3x slower steps); ``attention_copy``: a packed copy.
        # MatMulNBits graphs (int4, int8 in blocks) always take the packed copy: unpacked,
        # that kernel takes another compute path (logits ~0.05 apart), and a step carrying
        # one request's attention would move its neighbours' tokens
        self.diagnostics_options = self.options if attention_copy or nbits(self.manifest) \
            else session_options(self.options.intra_op_num_threads, spin, prepack=False)
        self.ort_seconds = 0.0  # time inside onnxruntime's runs, all calls (profiling tools)
        # IO bindings built so far: a call that built one paid a one-time cost (and, for a new
        # input shape, onnxruntime's own first run of it), which the engine's step costs
        # leave out (``server.step_costs``)
        self.bindings_built = 0
        self._log_softmax: LogSoftmax | None = None

    def log_softmax(self, rows: np.ndarray) -> np.ndarray:
        """Log-probabilities of logits rows (T, V) (Score), on onnxruntime with the runner's
        thread count; its session is made on first use."""
        if self._log_softmax is None:
            self._log_softmax = LogSoftmax(self.options.intra_op_num_threads)
        return self._log_softmax(rows)

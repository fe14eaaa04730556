"""Shared, session-scoped fixtures for the export tests.

Dynamo exports cost seconds each, so every artifact is exported once per session, lazily (a
test that needs one config exports only that one), and tests that modify an artifact work on
a copy (``artifact_copy``).

The configuration matrix: each config varies several options at once, and every option value
appears in at least one config (``test_matrix_covers_every_option`` checks that):

=========  ==========  =========  =====  ========  =========  =====  ======  ===============
config     positions   norm       place  final     ffn        heads  tied    biases
=========  ==========  =========  =====  ========  =========  =====  ======  ===============
llama      rope        rmsnorm    pre    yes       swiglu     GQA    yes     none
gpt2       learned     layernorm  pre    yes       gelu_tanh  MHA    yes     all
postln     learned     layernorm  post   no        gelu       MHA    no      all      (int8)
sinus      sinusoidal  rmsnorm    post   yes       gelu_tanh  MQA    yes     qkv+ffn  (fp16)
nopos      none        layernorm  pre    no        relu       GQA    no      out      (int4)
=========  ==========  =========  =====  ========  =========  =====  ======  ===============

All are exported as fused graphs (head_dim 16); ``llama`` also as the portable graphs
(``store.artifact("llama", portable=True)``). ``llama`` is exported with the
attention-diagnostics graph (fp32) and is the artifact most tests share; ``postln``, ``sinus``
and ``nopos`` are exported as int8, fp16 and int4 (their manifests still carry the fp32 parity
figures measured before the precision transform).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from export_matrix import BASE, EXPORTS, MAIN, THREADS, TEXTS, make_model  # noqa: E402

from kvserve.export.logs import quiet_torch_exporter  # noqa: E402
from kvserve.export.pipeline import export_artifacts  # noqa: E402
from kvserve.model.checkpoint import load_model, save_checkpoint  # noqa: E402
from kvserve.model.tokenizer import train_bpe  # noqa: E402
from kvserve.artifact.loader import load_lm  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _quiet_exporter():
    quiet_torch_exporter()


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread():
    """These models are tiny: a second OpenMP thread only spins (and on a shared 2-core
    machine it makes each small matmul wait for a busy core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer_json() -> str:
    return train_bpe(TEXTS, vocab_size=BASE["vocab_size"]).to_str()


class _Store:
    """Lazily built checkpoints and artifacts, one per config name, for the whole session."""

    def __init__(self, root: Path, tokenizer_json: str):
        self.root, self.tokenizer_json = root, tokenizer_json
        self._ckpt: dict[str, Path] = {}
        self._art: dict[str, Path] = {}

    def checkpoint(self, name: str) -> Path:
        if name not in self._ckpt:
            self._ckpt[name] = save_checkpoint(self.root / "ckpt" / name, make_model(name),
                                               tokenizer_json=self.tokenizer_json)
        return self._ckpt[name]

    def artifact(self, name: str, portable: bool = False) -> Path:
        key = name + (":portable" if portable else "")
        if key not in self._art:
            precision, attention = EXPORTS[name]
            self._art[key] = export_artifacts(
                self.checkpoint(name), self.root / "art" / key.replace(":", "-"),
                precision=precision, attention=attention, portable=portable, progress=False,
                threads=THREADS)
        return self._art[key]


@pytest.fixture(scope="session")
def store(tmp_path_factory, tokenizer_json) -> _Store:
    return _Store(tmp_path_factory.mktemp("export"), tokenizer_json)


@pytest.fixture(scope="session")
def main_ckpt(store) -> Path:
    return store.checkpoint(MAIN)


@pytest.fixture(scope="session")
def main_artifact(store) -> Path:
    """The fp32 ``llama`` artifact with all four graphs. Read-only: copy before modifying."""
    return store.artifact(MAIN)


@pytest.fixture(scope="session")
def main_model(main_ckpt):
    return load_model(main_ckpt)


@pytest.fixture(scope="session")
def main_lm(main_artifact):
    return load_lm(main_artifact, provider="cpu", threads=THREADS, attention=True)


@pytest.fixture
def artifact_copy(main_artifact, tmp_path) -> Path:
    dst = tmp_path / "artifact"
    shutil.copytree(main_artifact, dst)
    return dst

"""Fixtures for the runner tests: the export matrix's ``llama`` model (tests/export_matrix.py)
exported once as a fused and once as a portable artifact, and a runner of each kind (the fused
one twice: also as onnxruntime releases without ``query_seqlens`` run it)."""
from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")  # the portable graphs are torch.onnx exports

from export_matrix import MAIN, THREADS, make_model  # noqa: E402

from kvserve.artifact.fused import FusedLM  # noqa: E402
from kvserve.artifact.portable import PortableLM  # noqa: E402
from kvserve.export.logs import quiet_torch_exporter  # noqa: E402
from kvserve.export.pipeline import export_artifacts  # noqa: E402
from kvserve.model.checkpoint import save_checkpoint  # noqa: E402


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread():
    """Tiny models: a second OpenMP thread only spins on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    quiet_torch_exporter()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def main_model():
    return make_model(MAIN)


@pytest.fixture(scope="package")
def artifacts(tmp_path_factory, main_model) -> dict:
    root = tmp_path_factory.mktemp("runners")
    ckpt = save_checkpoint(root / "ckpt", main_model)
    return {kind: export_artifacts(ckpt, root / kind, attention=False, portable=kind == "portable",
                                   progress=False, threads=THREADS)
            for kind in ("fused", "portable")}


@pytest.fixture(scope="package", params=["fused", "fused-onnxruntime",
                                         "fused-padding-counted", "portable"])
def lm(request, artifacts):
    """``fused``: kvserve's native attention kernel where it is built
    (``artifact.native_attention``); ``fused-onnxruntime``: onnxruntime's GroupQueryAttention;
    ``fused-padding-counted``: the fused graph as an onnxruntime without GroupQueryAttention's
    ``query_seqlens`` runs it (before 1.32: ``artifact.gqa_compat``)."""
    if request.param == "portable":
        return PortableLM(artifacts["portable"], provider="cpu", threads=THREADS,
                          attention=False)
    return FusedLM(artifacts["fused"], provider="cpu", threads=THREADS, attention=False,
                   padding_counted=request.param == "fused-padding-counted",
                   attention_kernel="onnxruntime" if request.param == "fused-onnxruntime"
                   else "auto")

"""Server test fixtures: one tiny artifact (random init, fixed seed) built once per session, the
torch model kept for reference comparisons, and a real gRPC server on loopback."""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

torch = pytest.importorskip("torch")

TRAIN_TEXTS = [
    f"# doc {i}\n" + s
    for i in range(40)
    for s in (
        "def add(a, b):\n    return a + b\n",
        "naïve café, 日本語のテキスト, emoji 😀🚀, Ünïcödé ñ\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
        "for i in range(10):\n    print(i * 2)\n",
    )
]
SEED = 1234


@dataclass
class Artifact:
    dir: Path
    model: "torch.nn.Module"
    tokenizer: object
    cfg: object


def _build_manually(model, cfg, tok, out: Path) -> None:
    from kvserve.export.onnx_export import export_graph
    from kvserve.export.spec import ALL_SPECS

    for spec in ALL_SPECS:
        export_graph(model, spec, out)
    cfg.save(out / "config.json")
    tok.save(out / "tokenizer.json")
    graphs = {s.name: {"file": s.filename, "inputs": s.input_names(cfg),
                       "outputs": s.output_names(cfg)} for s in ALL_SPECS}
    try:
        from kvserve.export.manifest import write_manifest
    except ImportError:
        (out / "manifest.json").write_text(json.dumps({"graphs": graphs}))
    else:
        write_manifest(out, {"graphs": graphs})


def build_artifact(root: Path) -> Artifact:
    from kvserve.model.config import preset
    from kvserve.model.tokenizer import train_bpe
    from kvserve.model.transformer import Transformer

    tok = train_bpe(TRAIN_TEXTS, vocab_size=512, min_frequency=1)
    cfg = preset("tiny", vocab_size=tok.vocab_size, eos_token_id=tok.eos_id,
                 pad_token_id=tok.pad_id, init_std=0.1)
    torch.manual_seed(SEED)
    model = Transformer(cfg).eval()
    out = root / "artifact"
    try:
        from kvserve.export.pipeline import export_artifacts
    except ImportError:
        out.mkdir(parents=True)
        _build_manually(model, cfg, tok, out)
    else:
        from kvserve.model.checkpoint import save_checkpoint

        ckpt = save_checkpoint(root / "ckpt", model, tokenizer_json=tok.to_str())
        out = Path(export_artifacts(ckpt, out, attention=True, precision="fp32",
                                    progress=False, threads=2))
    return Artifact(out, model, tok, cfg)


# The `artifact` fixture (built by build_artifact above) is in tests/conftest.py, so that
# tests/server and tests/clients share one build per session.


def server_config(**kw):
    from kvserve.server.config import ServerConfig

    base = dict(host="127.0.0.1", port=0, metrics_port=-1, threads=1, max_batch=4,
                max_queue=16, drain_grace=2.0)
    base.update(kw)
    return ServerConfig(**base)


@contextlib.contextmanager
def running_app(artifact: Artifact, **kw):
    from kvserve.server.app import App

    app = App(artifact.dir, server_config(**kw))
    app.load()
    app.start()
    try:
        yield app
    finally:
        app.drain(0.5)


@pytest.fixture(scope="session")
def app(artifact):
    with running_app(artifact, metrics_port=0, max_logits_floats=50_000,
                     max_attention_floats=50_000) as a:
        yield a


@pytest.fixture(scope="session")
def channel(app):
    ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
    grpc.channel_ready_future(ch).result(timeout=10)
    yield ch
    ch.close()


@pytest.fixture(scope="session")
def stub(channel):
    from kvserve.v1 import inference_pb2_grpc

    return inference_pb2_grpc.InferenceStub(channel)

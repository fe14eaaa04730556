"""One imported, exported and served artifact per family, shared by that family's checks.

The fixture is module-scoped and parametrised by family, so pytest runs every check of one
family against one server before building the next family's (one export each: the fused graph
takes a second, a portable one, ``family_models.PORTABLE``, a dynamo export of many)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

sys.path.insert(0, str(Path(__file__).parent))

from family_models import (CASES, PORTABLE, PROMPT, SPIECE, build, save,  # noqa: E402
                           sentencepiece_tokenizer)
from kvserve.export.logs import quiet_torch_exporter  # noqa: E402
from kvserve_testing import TRAIN_TEXTS, ready_channel, running_app  # noqa: E402

FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3_longrope",
            "smollm3", "phi3", "smollm2"]


@dataclass
class Served:
    name: str
    hf: object  # the transformers model (the reference)
    hf_dir: Path
    ckpt: Path
    artifact: Path
    eos: list[int]
    eos_prefix: dict[int, int]  # eos id -> a prefix length of PROMPT after which it is greedy
    stub: object
    tokenizer_json: str


@torch.no_grad()
def pick_eos(hf) -> dict[int, int]:
    """The generation config's three EOS ids: distinct greedy predictions after prefixes of
    PROMPT, so that each one is reached (``PROMPT[:k]`` -> that id) and must stop generation.
    Returns {eos id: prefix length}."""
    nxt = hf(torch.tensor([PROMPT])).logits[0].argmax(-1).tolist()  # after PROMPT[:k+1]
    out: dict[int, int] = {}
    for k, t in enumerate(nxt):
        if t not in out and t > 2:
            out[t] = k + 1
    assert len(out) >= 3, f"greedy predictions too repetitive: {nxt}"
    return dict(list(out.items())[:3])


@pytest.fixture(scope="package", autouse=True)
def _setup():
    quiet_torch_exporter()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):

    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.hf_import import import_hf
    from kvserve.model.tokenizer import train_bpe
    from kvserve.v1 import inference_pb2_grpc

    name = request.param
    root = tmp_path_factory.mktemp(name)
    hf = build(name)
    tok = sentencepiece_tokenizer(TRAIN_TEXTS) if name in SPIECE else \
        train_bpe(TRAIN_TEXTS, vocab_size=CASES[name][1]["vocab_size"]).to_str()
    eos_prefix = pick_eos(hf)
    eos = list(eos_prefix)
    hf_dir = save(hf, root / "hf", tokenizer_json=tok, eos=eos)
    ckpt = import_hf(hf_dir, root / "ckpt")
    art = export_artifacts(ckpt, root / "art", attention=False, progress=False, threads=1)
    kind = json.loads((art / "manifest.json").read_text())["kind"]
    assert kind == ("portable" if name in PORTABLE else "fused"), (name, kind)

    class _A:  # what running_app needs
        dir = art

    with running_app(_A, max_batch=4) as app:
        with ready_channel(app.port) as ch:
            yield Served(name, hf, hf_dir, ckpt, art, eos, eos_prefix,
                         inference_pb2_grpc.InferenceStub(ch), tok)

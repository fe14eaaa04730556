"""The generated stubs in kvserve/v1 are what protos/ generates now (no stale stubs)."""
from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path):
    gen = runpy.run_path(str(ROOT / "scripts" / "gen_protos.py"))["generate"]
    outputs = gen(tmp_path)
    assert outputs, "no .proto files found"
    for out in outputs:
        rel = out.relative_to(tmp_path)
        current = ROOT / rel
        assert current.is_file(), f"{rel} is missing: run python scripts/gen_protos.py"
        assert current.read_bytes() == out.read_bytes(), \
            f"{rel} is stale: run python scripts/gen_protos.py"


def test_service_shape():
    from kvserve.v1 import inference_pb2 as pb

    svc = pb.DESCRIPTOR.services_by_name["Inference"]
    assert svc.full_name == "kvserve.v1.Inference"
    methods = {m.name: m for m in svc.methods}
    assert set(methods) == {"Generate", "Score", "Tokenize", "Detokenize", "ModelInfo"}
    assert methods["Generate"].server_streaming and not methods["Score"].server_streaming

"""Generate the Python gRPC stubs from protos/ (run by the build; never edit the output by hand).

    python scripts/gen_protos.py [OUT_DIR]

OUT_DIR defaults to the repository root, so `protos/kvserve/v1/x.proto` becomes
`kvserve/v1/x_pb2.py` (+ `_pb2_grpc.py`, `.pyi`), importable as `kvserve.v1.x_pb2`.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path = ROOT) -> list[Path]:
    from grpc_tools import protoc  # build-time dependency only
    import grpc_tools

    files = proto_files()
    if not files:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(f) for f in files],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(map(str, files)))
    outputs = []
    for f in files:
        rel = f.relative_to(PROTO_ROOT).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            outputs.append(out_dir / (str(rel) + suffix))
    return outputs


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for p in generate(target):
        print(p)

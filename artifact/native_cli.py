"""``kvserve native``: build kvserve's native CPU attention library, or say which one this
machine would use and why (``native_build``, ``native_attention``)."""
from __future__ import annotations

import sys


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=("build", "status"),
                        help="build: compile it now (fetching onnxruntime's API headers from "
                             "Debian's libonnxruntime-dev once, checked against a pinned "
                             "SHA-256, unless KVSERVE_ORT_INCLUDE names them); status: where "
                             "it is, or why there is none")
    parser.add_argument("--no-download", action="store_true",
                        help="build: fail rather than download the headers")


def main(args) -> int:
    from . import native_build

    if args.action == "build":
        try:
            lib = native_build.build(download=not args.no_download)
        except (RuntimeError, OSError) as e:
            print(f"kvserve native build: FAILED: {e}", file=sys.stderr)
            return 1
        print(f"kvserve native build: {lib} ({_flags(lib)})")
        return 0
    lib, why = native_build.library()
    if lib is None:
        print(f"kvserve native status: none: {why}")
        return 1
    print(f"kvserve native status: {lib} ({_flags(lib)})")
    return 0


def _flags(lib) -> str:
    import json
    from pathlib import Path

    stamp = json.loads((Path(lib).parent / "stamp.json").read_text())
    return "built with " + (", ".join(stamp["flags"]) or "the compiler's default vector width")

"""``kvserve verify ARTIFACTS``: the artifact is exactly what the manifest says, or nothing loads.

Checks, in order: the directory is sane; with a trusted key, manifest.sig signs exactly these
manifest bytes (artifact/signing.py); the manifest passes its schema and config.json its bounds
(artifact/schema.py); every listed file stays inside the directory (no absolute path, no ``..``,
no symlink anywhere on its path) and matches its size and sha256; no unlisted files; each graph
passes ``onnx.checker``, has the manifest's I/O, and keeps its external-data locations inside
the directory and listed; the config agrees with the shapes the graphs declare. The server
runs the same function before loading. Torch-free.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path, PurePosixPath
from typing import Any

from . import schema, signing
from .manifest import MANIFEST, list_files, sha256_file

CONFIG = "config.json"

log = logging.getLogger(__name__)


class VerifyError(Exception):
    """The artifact does not match its manifest; the message says what and where."""


def _safe_relpath(root: Path, rel: str, what: str) -> Path:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or "\\" in rel or any(part in ("..", "") for part in p.parts) \
            or os.path.isabs(rel):
        raise VerifyError(f"{what} {rel!r} escapes the artifact directory")
    path = root
    for part in p.parts:
        path = path / part
        if path.is_symlink():
            raise VerifyError(f"{what} {rel!r} goes through a symlink ({path.name}); symlinks "
                              f"are refused")
    resolved = path.resolve()
    if root.resolve() not in resolved.parents:
        raise VerifyError(f"{what} {rel!r} escapes the artifact directory")
    return path


def verify_artifacts(root: str | Path, check_graphs: bool = True,
                     trusted_key: str | Path | None = None,
                     check_hashes: bool = True) -> dict[str, Any]:
    """Raises VerifyError unless the artifact is exactly what its manifest says (and, with
    ``trusted_key``, the manifest carries a valid signature by that key). Returns the
    manifest. ``check_hashes=False`` (``serve --no-verify``) skips the sha256 of the files and
    keeps the cheap checks: paths, sizes, schema, config against the graphs."""
    root = Path(root)
    if root.is_symlink():
        raise VerifyError(f"artifact directory {root} is a symlink; refused")
    if not root.is_dir():
        raise VerifyError(f"artifact directory {root} does not exist")
    mpath = root / MANIFEST
    if mpath.is_symlink() or not mpath.is_file():
        raise VerifyError(f"{root} has no {MANIFEST} (not an exported artifact)")
    try:
        if mpath.stat().st_size > schema.MAX_MANIFEST_BYTES:
            raise schema.SchemaError(f"{MANIFEST} has {mpath.stat().st_size} bytes; the limit "
                                     f"is {schema.MAX_MANIFEST_BYTES}")
        data = mpath.read_bytes()  # read once: the signature and the checks see these bytes
        if trusted_key is not None:
            signing.verify_manifest(root, data, trusted_key)
        manifest = schema.check_manifest(schema.load_json(mpath, MANIFEST,
                                                          schema.MAX_MANIFEST_BYTES, data))
        files: dict[str, dict] = manifest["files"]
        graphs: dict[str, dict] = manifest["graphs"]
        cfg = _model_config(root, files)
    except (schema.SchemaError, signing.SignatureError) as e:
        raise VerifyError(str(e)) from None

    for rel, entry in files.items():
        path = _safe_relpath(root, rel, "manifest file")
        if not path.is_file():
            raise VerifyError(f"{rel} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise VerifyError(f"{rel} has {size} bytes, the manifest says {entry.get('bytes')} "
                              f"(truncated or replaced)")
        if check_hashes and sha256_file(path) != entry.get("sha256"):
            raise VerifyError(f"{rel} does not match its sha256 in the manifest (modified)")
    for p in root.rglob("*"):
        if p.is_symlink():
            raise VerifyError(f"{p.relative_to(root).as_posix()} is a symlink; refused")
    extra = sorted(set(list_files(root)) - set(files))
    if extra:
        raise VerifyError(f"files not in the manifest: {', '.join(extra)}")

    models = {}
    for name, g in graphs.items():
        rel = g.get("file", "")
        path = _safe_relpath(root, rel, f"graph {name}")
        if rel not in files:
            raise VerifyError(f"graph {name} file {rel!r} is not hashed in the manifest")
        models[name] = _load_graph(path, name)
        if check_graphs:
            _check_graph(root, path, name, g, files, models[name])
    try:  # before any buffer is sized from the config
        schema.check_config_against_graphs(
            cfg, models, paired=bool(manifest.get("runtime", {}).get("paired_attention")))
    except schema.SchemaError as e:
        raise VerifyError(str(e)) from None
    return manifest


def _model_config(root: Path, files: dict):
    """config.json, listed and bounded (read before the hashes: it is small and capped)."""
    if CONFIG not in files:
        raise schema.SchemaError(f"{MANIFEST} does not list {CONFIG}")
    path = _safe_relpath(root, CONFIG, "manifest file")
    if not path.is_file():
        raise schema.SchemaError(f"{CONFIG} is listed in the manifest but missing")
    return schema.check_model_config(schema.load_json(path, CONFIG, schema.MAX_CONFIG_BYTES))


def _load_graph(path: Path, name: str):
    import onnx  # deferred: imports stay light

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception:
        raise VerifyError(f"graph {name} ({path.name}) is not a readable ONNX model") from None


def _check_graph(root: Path, path: Path, name: str, g: dict, files: dict, model) -> None:
    import onnx

    for tensor in _all_tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            loc = {e.key: e.value for e in tensor.external_data}.get("location", "")
            _safe_relpath(path.parent, loc, f"graph {name} external data location")
            rel = (path.parent / loc).relative_to(root).as_posix()
            if rel not in files:
                raise VerifyError(f"graph {name} external data {loc!r} is not in the manifest")
    try:
        onnx.checker.check_model(str(path))
    except Exception as e:
        raise VerifyError(f"graph {name} fails onnx.checker: {str(e).splitlines()[0][:200]}") \
            from None
    want_in, want_out = g.get("inputs"), g.get("outputs")
    got_in = [i.name for i in model.graph.input]
    got_out = [o.name for o in model.graph.output]
    if want_in is not None and got_in != list(want_in):
        raise VerifyError(f"graph {name} inputs {got_in} differ from the manifest")
    if want_out is not None and got_out != list(want_out):
        raise VerifyError(f"graph {name} outputs {got_out} differ from the manifest")


def _all_tensors(graph):
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for sub in attr.graphs:
                yield from _all_tensors(sub)


def add_arguments(parser) -> None:
    parser.add_argument("artifacts", help="artifact directory written by `kvserve export`")
    parser.add_argument("--no-graphs", action="store_true",
                        help="only check hashes and paths, skip onnx.checker")
    parser.add_argument("--trusted-key", default=None,
                        help="Ed25519 public key (PEM): also require the manifest's signature "
                             "(manifest.sig) by this key")


def main(args) -> int:
    try:
        manifest = verify_artifacts(args.artifacts, check_graphs=not args.no_graphs,
                                    trusted_key=args.trusted_key)
    except VerifyError as e:
        print(f"kvserve verify: FAILED: {e}", file=sys.stderr)
        return 1
    n = len(manifest["files"])
    print(f"kvserve verify: OK: {n} files match their sha256, graphs "
          f"{', '.join(sorted(manifest['graphs']))} pass onnx.checker "
          f"(precision {manifest.get('precision', '?')})"
          + (", manifest signed by the trusted key" if args.trusted_key else ""))
    return 0

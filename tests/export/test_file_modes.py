"""Every artifact file gets the same mode, the one a plain open() gives under the umask (0644
under 022): onnx.save writes external data (model.onnx.data) 0600, which a server running as
another user (a container's uid 10001 on a host export mounted read-only) could not read."""
from __future__ import annotations

import os
import stat

import pytest


@pytest.fixture(scope="module", params=["fused", "portable"])
def art(request, store, main_artifact):
    return main_artifact if request.param == "fused" else store.artifact("llama", portable=True)


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def test_every_file_has_the_umask_mode(art):
    modes = {p.relative_to(art).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in art.rglob("*") if p.is_file()}
    assert any(name.endswith(".onnx.data") for name in modes), sorted(modes)
    want = 0o666 & ~_umask()
    assert {n: oct(m) for n, m in modes.items() if m != want} == {}, oct(want)


def test_readable_modes_applies_the_callers_umask(tmp_path):
    from kvserve.export.pipeline import readable_modes

    (tmp_path / "sub").mkdir()
    for name, mode in (("a.onnx.data", 0o600), ("sub/b.json", 0o640), ("c", 0o777)):
        (tmp_path / name).write_bytes(b"x")
        (tmp_path / name).chmod(mode)
    old = os.umask(0o027)
    try:
        readable_modes(tmp_path)
    finally:
        os.umask(old)
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in tmp_path.rglob("*")
            if p.is_file()} == {"a.onnx.data": "0o640", "b.json": "0o640", "c": "0o640"}

"""kvserve's native CPU attention (``artifact.native_attention``, ``artifact.native_build``):
the op against onnxruntime's GroupQueryAttention on random calls of many shapes, the fused
runner with it against the runner with onnxruntime's kernel, what the rewrite leaves alone,
the fallbacks (no library, a failed check), and the headers' download. The runner tests
(``lm``'s ``fused`` and ``fused-onnxruntime``) run every call shape on both kernels."""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import onnx
import pytest

from kvserve.artifact import native_attention as NA
from kvserve.artifact import native_build as NB
from kvserve.artifact.fused import FusedLM


@pytest.fixture
def library(native_library) -> str:
    return native_library


def _sets():
    """Attribute sets over the op's range: group sizes 1-16, head sizes 16-128, windows
    shorter and longer than a key tile (64), soft-capping, full and partial rotary, no
    rotary, an explicit scale."""
    g = np.random.default_rng(7)
    out = []
    for heads, kv in ((4, 4), (8, 2), (12, 4), (16, 1), (6, 3)):
        for head in (16, 32, 64, 128):
            out.append(dict(heads=heads, kv_heads=kv, head=head,
                            window=int(g.choice([-1, -1, 5, 33, 90])),
                            softcap=float(g.choice([0.0, 0.0, 30.0])),
                            rotary=int(g.choice([0, head // 2, max(8, head // 4)])),
                            scale=float(g.choice([0.0, 0.2]))))
    return out


@pytest.mark.parametrize("attrs", _sets(), ids=lambda s: "h{heads}-kv{kv_heads}-d{head}-w"
                         "{window}-c{softcap:g}-r{rotary}-s{scale:g}".format(**s))
def test_the_op_equals_onnxruntimes(library, attrs):
    """Decode rows, prompts over several key tiles, right-padded and ragged rows, a chunk after
    a long past: outputs within 1e-5 of their scale, the written cache rows too."""
    assert NA.check(library, attrs, ["CPUExecutionProvider"]) <= 1e-5


def test_the_fused_runner_equals_onnxruntimes_kernel(library, artifacts):
    """Ragged prompts, a second chunk with a past, decode steps and a ragged verification:
    the same logits (1e-4) and cache rows with either kernel."""
    a = FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False)
    b = FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False,
                attention_kernel="onnxruntime")
    assert a.attention_kernel.startswith("kvserve native attention")
    assert b.attention_kernel == NA.ONNXRUNTIME
    V = a.cfg.vocab_size
    g = np.random.default_rng(11)
    prompts = [g.integers(0, V, n).tolist() for n in (70, 3, 129)]
    chunk = [g.integers(0, V, n).tolist() for n in (40, 1, 9)]
    rows = [g.integers(0, V, n).tolist() for n in (5, 1, 3)]
    got = []
    for lm in (a, b):
        kv = lm.new_cache(3)
        out = [r.copy() for r in lm.prefill(kv, 0, prompts).logits]
        out += [r.copy() for r in lm.prefill(kv, 0, chunk).logits]
        for step in range(4):
            out.append(lm.decode(kv, 3, [step + 7] * 3)[0].copy())
        logits = lm.verify(kv, 3, rows)
        out += [logits[i, :len(r)].copy() for i, r in enumerate(rows)]
        used = kv.used[:3].copy()
        cache = [np.asarray(kv.k[0])[:3].copy(), np.asarray(kv.v[-1])[:3].copy()]
        got.append((out, used, cache))
    (oa, ua, ca), (ob, ub, cb) = got
    assert (ua == ub).all()
    assert max(float(np.abs(x - y).max()) for x, y in zip(oa, ob)) <= 1e-4
    for x, y in zip(ca, cb):
        for s, n in enumerate(ua):
            assert float(np.abs(x[s, :, :n] - y[s, :, :n]).max()) <= 1e-5


def test_the_rewrite_is_in_memory_and_leaves_what_it_cannot_take(library, artifacts):
    path = artifacts["fused"] / "model.onnx"
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    model = onnx.load(str(path), load_external_data=False)
    gqa = [n for n in model.graph.node if n.op_type == NA.GQA]
    inputs = NA._kv_types(model.graph)
    assert gqa and all(NA.why_not(n, inputs) is None for n in gqa)
    # attention weights asked for, interleaved rotary, an input the op does not read
    first, second, third = gqa[0], gqa[1], gqa[-1]
    first.output.append("weights")
    second.attribute.append(onnx.helper.make_attribute("rotary_interleaved", 1))
    for a in second.attribute:
        if a.name == "rotary_interleaved" and a.i == 0:
            second.attribute.remove(a)
            break
    third.input[10] = "bias"
    skipped = {first.name, second.name, third.name}
    reasons = [NA.why_not(n, inputs) for n in (first, second, third)]
    assert all(reasons), reasons
    assert NA.rewrite(model) == len(gqa) - len(skipped)
    kinds = {n.name: (n.domain, n.op_type) for n in model.graph.node}
    assert all(kinds[n] == ("com.microsoft", NA.GQA) for n in skipped)
    assert sum(v == (NA.DOMAIN, NA.OP) for v in kinds.values()) == len(gqa) - len(skipped)


def test_a_float16_cache_keeps_onnxruntimes_op(library, tmp_path):
    """The matrix's fp16 export (``sinus``): no node the op takes."""
    from export_matrix import make_model
    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.checkpoint import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "ckpt", make_model("sinus"))
    art = export_artifacts(ckpt, tmp_path / "art", attention=False, precision="fp16",
                           progress=False, threads=1)
    lm = FusedLM(art, provider="cpu", threads=1, attention=False)
    assert lm.attention_kernel.startswith(NA.ONNXRUNTIME)
    assert "no node the native op takes" in lm.attention_kernel


def test_without_the_library_onnxruntimes_kernel_runs(artifacts, monkeypatch):
    monkeypatch.setattr(NB, "library", lambda: (None, "the native attention library is not "
                                                      "built (no C++ compiler)"))
    lm = FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False)
    assert lm.attention_kernel.startswith(NA.ONNXRUNTIME)
    assert "no C++ compiler" in lm.attention_kernel
    kv = lm.new_cache(1)
    assert lm.prefill(kv, 0, [[1, 2, 3]], last=True).logits[0].shape == (1, lm.cfg.vocab_size)
    with pytest.raises(RuntimeError, match="'native' asked for, but .*no C\\+\\+ compiler"):
        FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False,
                attention_kernel="native")
    with pytest.raises(ValueError, match="one of auto, native, onnxruntime"):
        FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False,
                attention_kernel="fast")


def test_a_failed_check_keeps_onnxruntimes_kernel(library, artifacts, monkeypatch, caplog):
    monkeypatch.setattr(NA, "_checked", lambda lib, key: 3e-2)
    with caplog.at_level(logging.WARNING, logger=NA.__name__):
        lm = FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False)
    assert lm.attention_kernel.startswith(NA.ONNXRUNTIME) and "3.0e-02" in lm.attention_kernel
    assert "differs from onnxruntime's" in caplog.text


def _deb(header: bytes) -> bytes:
    """A Debian package (an ``ar`` archive) whose data.tar.xz holds one header where
    libonnxruntime-dev keeps them."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        info = tarfile.TarInfo("./usr/include/onnxruntime/onnxruntime_cxx_api.h")
        info.size = len(header)
        tar.addfile(info, io.BytesIO(header))
    out = b"!<arch>\n"
    for name, data in ((b"debian-binary", b"2.0\n"), (b"control.tar.xz", b"x"),
                       (b"data.tar.xz", buf.getvalue())):
        out += name.ljust(16) + b"0".ljust(12) + b"0".ljust(6) + b"0".ljust(6) + \
            b"100644".ljust(8) + str(len(data)).encode().ljust(10) + b"`\n" + data
        out += b"\n" if len(data) % 2 else b""
    return out


def test_headers_come_from_the_pinned_debian_package(tmp_path, monkeypatch):
    deb = _deb(b"// the header\n")
    (tmp_path / "pkg.deb").write_bytes(deb)
    monkeypatch.setenv("KVSERVE_NATIVE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVSERVE_ORT_INCLUDE", raising=False)
    monkeypatch.setattr(NB, "DEB_URL", (tmp_path / "pkg.deb").as_uri())
    monkeypatch.setattr(NB, "DEB_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="SHA-256 differs"):
        NB.headers()
    assert NB.headers(download=False) is None
    monkeypatch.setattr(NB, "DEB_SHA256", hashlib.sha256(deb).hexdigest())
    home = NB.headers()
    assert (home / NB.HEADER).read_bytes() == b"// the header\n"
    assert NB.headers(download=False) == home  # (cached: no second download)


def test_a_library_built_for_another_cpu_is_not_used(library, tmp_path, monkeypatch):
    key = NB._key(NB._vector_flags())
    shutil.copytree(os.path.dirname(library), tmp_path / key)
    stamp = tmp_path / key / "stamp.json"
    monkeypatch.setenv("KVSERVE_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(NB, "PACKAGED", tmp_path / "none")
    monkeypatch.setenv("KVSERVE_ORT_INCLUDE", str(tmp_path / "no-headers"))
    assert NB.library()[0] == str(tmp_path / key / NB.LIB)
    data = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**data, "flags": [*data["flags"], "a_flag_no_cpu_has"]}))
    lib, why = NB.library()
    assert lib is None and "kvserve native build" in why


def test_a_library_not_as_built_or_writable_by_others_is_not_used(library, tmp_path,
                                                                     monkeypatch):
    """The stamp's SHA-256 of the library, and no group or world write on the directories,
    the stamp and the library (whoever could write them could run code in the server)."""
    key = NB._key(NB._vector_flags())
    home = tmp_path / key
    shutil.copytree(os.path.dirname(library), home)
    monkeypatch.setenv("KVSERVE_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(NB, "PACKAGED", tmp_path / "none")
    monkeypatch.setenv("KVSERVE_ORT_INCLUDE", str(tmp_path / "no-headers"))
    assert NB.library()[0] == str(home / NB.LIB)
    for path in (home, home / NB.LIB, home / "stamp.json"):
        mode = path.stat().st_mode
        path.chmod(mode | 0o020)
        assert NB.library()[0] is None, path
        path.chmod(mode)
    with open(home / NB.LIB, "ab") as f:
        f.write(b"\0")
    assert NB.library()[0] is None


def test_the_packaged_library_is_trusted_as_the_packages_code(library, tmp_path, monkeypatch):
    """A pip install under umask 002 leaves the package's files group-writable, its Python
    files too: the package's own library is held to its stamp, not to the cache's rule."""
    key = NB._key(NB._vector_flags())
    home = tmp_path / "pkg" / key
    shutil.copytree(os.path.dirname(library), home)
    for path in (home.parent, home, home / NB.LIB, home / "stamp.json"):
        path.chmod(path.stat().st_mode | 0o020)
    monkeypatch.setattr(NB, "PACKAGED", tmp_path / "pkg")
    assert NB.library()[0] == str(home / NB.LIB)
    with open(home / NB.LIB, "ab") as f:
        f.write(b"\0")
    monkeypatch.setenv("KVSERVE_NATIVE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVSERVE_ORT_INCLUDE", str(tmp_path / "no-headers"))
    lib, why = NB.library()
    assert lib is None and "not the file its build wrote" in why


def test_a_rewritten_graph_onnxruntime_refuses_falls_back(library, artifacts, monkeypatch,
                                                           caplog):
    """(auto) A graph on the native ops that onnxruntime will not load (here: a node of an
    op the library does not have) loads as exported instead, saying why."""
    real = NA.prepare

    def broken(model, options, providers, mode="auto"):
        out = real(model, options, providers, mode)
        model.graph.node.append(onnx.helper.make_node("Nope", ["input_ids"], ["nope"],
                                                      domain=NA.DOMAIN))
        return out

    monkeypatch.setattr(NA, "prepare", broken)
    with caplog.at_level(logging.WARNING):
        lm = FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False)
    assert lm.attention_kernel.startswith(NA.ONNXRUNTIME) and "did not load" in lm.attention_kernel
    assert not lm.row_invariant_attention and "did not load" in caplog.text
    kv = lm.new_cache(1)
    assert lm.prefill(kv, 0, [[1, 2, 3]], last=True).logits[0].shape == (1, lm.cfg.vocab_size)
    with pytest.raises(Exception):
        FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False,
                attention_kernel="native")


def test_native_asked_for_holds_for_the_main_graph_only(library, artifact):
    """The attention-diagnostics graph returns the weights: onnxruntime's op there, and a
    request for attention still runs under --attention-kernel native."""
    lm = FusedLM(artifact.dir, provider="cpu", threads=1, attention=True,
                 attention_kernel="native")
    assert lm.has_attention and lm.attention_kernel.startswith("kvserve native attention")
    kv = lm.new_cache(1)
    out = lm.prefill(kv, 0, [[3, 4, 5, 6]], attention=True, last=True)
    assert out.attention is not None and lm.attention_ready


def test_the_cli_says_which_library(library):
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "native", "status"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and library in out.stdout and "built with" in out.stdout

"""``kvserve serve`` refuses a tampered artifact before loading anything: a clear one-line
message on stderr naming the problem, exit code 1, no port opened. And nothing on the load or
serving path ever unpickles.

(tests/export/test_verify.py checks ``verify_artifacts`` itself, in-process, case by case; here
the whole command is run the way an operator runs it.)
"""
from __future__ import annotations

import ast
import collections
import concurrent.futures
import importlib
import os
import pickle
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from hardening_helpers import collect, gen_request, running_app, serve_cmd

from kvserve_testing import read_manifest, rehash, relocate_external_data, write_manifest
from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc


# --- tampering -----------------------------------------------------------------------------------
def truncated_graph(root):
    p = root / "model.onnx"
    n = p.stat().st_size
    p.write_bytes(p.read_bytes()[:n // 2])
    return root, [rf"model.onnx has {n // 2} bytes, the manifest says {n} (truncated"]


def truncated_graph_rehashed(root):
    p = root / "model.onnx"
    p.write_bytes(p.read_bytes()[:100])
    rehash(root, "model.onnx")
    return root, ["graph model"]


def changed_byte_in_graph(root):
    p = root / "model_attn.onnx"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    return root, ["model_attn.onnx does not match its sha256 in the manifest (modified)"]


def changed_byte_in_weights(root):
    p = root / "model.onnx.data"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x80
    p.write_bytes(bytes(data))
    return root, ["model.onnx.data does not match its sha256"]


def manifest_wrong_hash(root):
    m = read_manifest(root)
    m["files"]["tokenizer.json"]["sha256"] = "0" * 64
    write_manifest(root, m)
    return root, ["tokenizer.json does not match its sha256"]


def manifest_unlisted_file(root):
    (root / "extra.onnx").write_bytes(b"not listed")
    return root, ["files not in the manifest: extra.onnx"]


def manifest_missing_file(root):
    (root / "config.json").unlink()
    return root, ["config.json is listed in the manifest but missing"]


def manifest_graph_io_mismatch(root):
    m = read_manifest(root)
    m["graphs"]["model"]["inputs"] = list(reversed(m["graphs"]["model"]["inputs"]))
    write_manifest(root, m)
    return root, ["graph model inputs", "differ from the manifest"]


def external_data_dotdot(root):
    shutil.copy(root / "model.onnx.data", root.parent / "model.onnx.data")
    relocate_external_data(root, "../model.onnx.data")
    return root, ["graph model external data location '../model.onnx.data' escapes the "
                  "artifact directory"]


def external_data_absolute(root):
    outside = root.parent / "elsewhere.data"
    shutil.copy(root / "model.onnx.data", outside)
    relocate_external_data(root, str(outside.resolve()))
    return root, ["graph model external data location", "escapes the artifact directory"]


def symlinked_file(root):
    target = root.parent / "outside-model.onnx.data"
    shutil.copy(root / "model.onnx.data", target)
    (root / "model.onnx.data").unlink()
    (root / "model.onnx.data").symlink_to(target)  # same bytes: the hash still matches
    return root, ["'model.onnx.data' goes through a symlink", "symlinks are refused"]


def symlinked_directory(root):
    link = root.parent / "link"
    link.symlink_to(root)
    return link, ["is a symlink; refused"]


TAMPERINGS = [truncated_graph, truncated_graph_rehashed, changed_byte_in_graph,
              changed_byte_in_weights, manifest_wrong_hash, manifest_unlisted_file,
              manifest_missing_file, manifest_graph_io_mismatch, external_data_dotdot,
              external_data_absolute, symlinked_file, symlinked_directory]


def _writable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    return dst


@pytest.fixture(scope="module")
def refusals(artifact, tmp_path_factory):
    """Every tampered copy served at once (they fail in the first second): name -> (rc, stderr,
    expected parts, port file)."""
    jobs = {}
    for fn in TAMPERINGS:
        tmp = tmp_path_factory.mktemp(fn.__name__)
        root, parts = fn(_writable_copy(artifact.dir, tmp / "artifact"))
        jobs[fn.__name__] = (root, parts, tmp / "port.json")

    def run(item):
        name, (root, parts, port_file) = item
        p = subprocess.run(serve_cmd(root, port_file), capture_output=True, text=True,
                           timeout=120, env={**os.environ, "KVSERVE_LOG_LEVEL": "WARNING"})
        return name, (p.returncode, p.stderr, parts, port_file)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return dict(pool.map(run, jobs.items()))


@pytest.mark.parametrize("name", [fn.__name__ for fn in TAMPERINGS])
def test_serve_refuses_tampered_artifact(refusals, name):
    rc, err, parts, port_file = refusals[name]
    assert rc == 1, err
    assert "kvserve serve: refusing to serve" in err, err
    for part in parts:
        assert part in err, (part, err)
    assert "Traceback" not in err
    assert not port_file.exists()  # it never served


# --- never unpickle ------------------------------------------------------------------------------
PACKAGES = ["kvserve", "kvserve.model", "kvserve.export", "kvserve.server", "kvserve.clients",
            "kvserve.bench", "kvserve.v1"]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve",
                  "marshal", "pickletools"}


def unpickling_sites(source: str, filename: str = "<src>") -> list[str]:
    """Code (not comments or strings) that can unpickle: importing a pickle-family module,
    torch.load / torch.jit.load, np.load(..., allow_pickle=True), pandas read_pickle, or
    anything passing weights_only=False."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names
                      if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where} from {node.module} import")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            if name.endswith(("torch.load", "jit.load", "read_pickle")) or name == "load" and \
                    "weights_only" in kw:
                found.append(f"{where} {name}()")
            if name.split(".")[-1] == "load" and isinstance(kw.get("allow_pickle"),
                                                            ast.Constant) and \
                    kw["allow_pickle"].value is True:
                found.append(f"{where} {name}(allow_pickle=True)")
            if isinstance(kw.get("weights_only"), ast.Constant) and \
                    kw["weights_only"].value is False:
                found.append(f"{where} {name}(weights_only=False)")
    return found


def test_the_scanner_finds_what_it_looks_for():
    bad = ("import pickle\nfrom joblib import load\nimport torch, numpy as np\n"
           "torch.load('x')\nnp.load('y', allow_pickle=True)\nimport dill.settings\n"
           "f(weights_only=False)\n")
    assert len(unpickling_sites(bad)) == 6
    ok = ('"""never pickle: torch.load is refused"""\n# import pickle\n'
          "import numpy as np\nnp.load('a.npy')\nx = 'pickle'\n")
    assert unpickling_sites(ok) == []


def test_no_unpickling_anywhere_in_the_installed_sources():
    files = set()
    for name in PACKAGES:
        for d in importlib.import_module(name).__path__:
            files |= {p.resolve() for p in Path(d).glob("*.py")}
    assert len(files) > 20
    sites = [s for f in sorted(files) for s in unpickling_sites(f.read_text(), str(f))]
    assert sites == []


def test_load_and_serve_without_unpickling(artifact, monkeypatch):
    """In-process: the artifact is verified and loaded and every RPC served while pickle's entry
    points raise, and an audit hook records any pickle.find_class (the event of any unpickling
    that resolves a global, whichever API or C extension started it). (marshal.loads is not
    watched: the import system raises it for every .pyc.)"""
    calls = []
    active = [True]

    def hook(event, args):
        if active[0] and event == "pickle.find_class":
            calls.append((event, args[:2]))

    sys.addaudithook(hook)  # hooks cannot be removed: it turns itself off below
    import _pickle  # the hook sees the C unpickler too (a positive control)
    _pickle.loads(pickle.dumps(collections.OrderedDict()))
    assert calls == [("pickle.find_class", ("collections", "OrderedDict"))]
    calls.clear()

    def refuse(*a, **kw):
        calls.append(("pickle", a[:1]))
        raise AssertionError("unpickling on the serving path")

    for attr in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, attr, refuse)
    try:
        with running_app(artifact) as app:
            ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
            stub = pb_grpc.InferenceStub(ch)
            _, done = collect(stub.Generate(gen_request("def f():", 4, top_logprobs=2)))
            assert done.generated_tokens == 4
            assert stub.Score(pb.ScoreRequest(texts=["ab cd"], top_logprobs=1)).sequences
            ids = stub.Tokenize(pb.TokenizeRequest(texts=["abc"])).tokens
            assert stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).texts == ["abc"]
            assert stub.ModelInfo(pb.ModelInfoRequest()).vocab_size == artifact.cfg.vocab_size
            ch.close()
    finally:
        active[0] = False
    assert calls == []

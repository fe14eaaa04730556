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
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from hardening_helpers import collect, gen_request, running_app, serve_cmd

from kvserve import cli
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


# --- re-hashed tampering: the manifest agrees with the files, the content is hostile ----------
def _config(root, **changes):
    c = json.loads((root / "config.json").read_text())
    c.update(changes)
    (root / "config.json").write_text(json.dumps(c))
    rehash(root, "config.json")
    return root


def config_n_layers_1e9(root):  # was: MemoryError after 7-30 s of allocation
    return _config(root, n_layers=10**9), ["config.json: n_layers must be an integer in "
                                           "[1, 1024], got 1000000000"]


def config_vocab_size_1e9(root):
    return _config(root, vocab_size=10**9), ["config.json: vocab_size must be an integer"]


def config_d_model_2_30(root):  # was: a 2 TiB allocation attempt
    return _config(root, d_model=2**30), ["config.json: d_model must be an integer in "
                                          "[1, 65536], got 1073741824"]


def config_max_seq_len_1e12(root):  # was: ValueError in ModelInfo
    return _config(root, max_seq_len=10**12), ["config.json: max_seq_len must be an integer"]


def config_n_layers_float(root):
    return _config(root, n_layers=2.0), ["config.json: n_layers must be an integer"]


def config_n_heads_not_the_graphs(root):  # was: a broadcast error in the warm-up
    return _config(root, n_heads=2), ["config.json does not match graph", "head_dim 32 in "
                                      "config.json, 16 in the graph"]


def config_n_layers_not_the_graphs(root):
    return _config(root, n_layers=3), ["config.json does not match graph", "n_layers 3"]


def config_vocab_not_the_graphs(root):
    return _config(root, vocab_size=500), ["config.json does not match graph", "vocab_size 500"]


def config_gqa_not_the_graphs(root):  # same head size, other KV heads
    return _config(root, n_kv_heads=4), ["config.json does not match graph", "n_kv_heads 4"]


def config_max_seq_len_past_the_graphs(root):  # was: onnxruntime's error at the first
    # position past RoPE's table ("cos_cache dimension 0 shall not be less than ...")
    n = json.loads((root / "config.json").read_text())["max_seq_len"]
    return _config(root, max_seq_len=n + 1), [
        "config.json does not match graph", f"max_seq_len {n + 1} in config.json, position "
                                            f"tables of {n} rows in the graph"]


def config_deeply_nested(root):
    (root / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    rehash(root, "config.json")
    return root, ["config.json is nested too deeply"]


def manifest_files_is_a_list(root):  # was: AttributeError
    m = read_manifest(root)
    m["files"] = list(m["files"])
    (root / "manifest.json").write_text(json.dumps(m))
    return root, ["manifest.json: files must be an object"]


def manifest_deeply_nested(root):  # was: RecursionError
    (root / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    return root, ["manifest.json is nested too deeply"]


def manifest_nested_beyond_the_schema(root):
    m = read_manifest(root)
    m["parity"]["x"] = json.loads("[" * 50 + "]" * 50)
    write_manifest(root, m)
    return root, ["manifest.json is nested more than 12 levels deep"]


def manifest_graph_without_file(root):
    m = read_manifest(root)
    m["graphs"]["decode"] = {"file": 7}
    write_manifest(root, m)
    return root, ["manifest.json: graphs['decode'] must be an object with a file name"]


def manifest_bytes_not_a_number(root):
    m = read_manifest(root)
    m["files"]["config.json"]["bytes"] = "494"
    write_manifest(root, m)
    return root, ["manifest.json: files['config.json'].bytes must be an integer"]


def manifest_logits_rows_not_a_name(root):
    m = read_manifest(root)
    m["runtime"]["logits_rows"] = ["logits_rows"]
    write_manifest(root, m)
    return root, ["manifest.json: runtime.logits_rows must be an input name of the main graph"]


def manifest_logits_rows_names_the_ids(root):  # would rebind input_ids to the rows array
    m = read_manifest(root)
    m["runtime"]["logits_rows"] = "input_ids"
    write_manifest(root, m)
    return root, ["manifest.json: runtime.logits_rows must be an input name of the main graph"]


def manifest_format_version_from_the_future(root):  # a newer exporter's contract
    m = read_manifest(root)
    m["format_version"] = 3
    write_manifest(root, m)
    return root, ["manifest.json: format_version 3 is not one this kvserve reads (1 to 2): it "
                  "was made by a newer kvserve"]


REHASHED = [config_n_layers_1e9, config_vocab_size_1e9, config_d_model_2_30,
            config_max_seq_len_1e12, config_n_layers_float, config_n_heads_not_the_graphs,
            config_n_layers_not_the_graphs, config_vocab_not_the_graphs, config_gqa_not_the_graphs,
            config_max_seq_len_past_the_graphs, config_deeply_nested, manifest_files_is_a_list, manifest_deeply_nested,
            manifest_nested_beyond_the_schema, manifest_graph_without_file,
            manifest_bytes_not_a_number, manifest_logits_rows_not_a_name,
            manifest_logits_rows_names_the_ids, manifest_format_version_from_the_future]
TAMPERINGS = [truncated_graph, truncated_graph_rehashed, changed_byte_in_graph,
              changed_byte_in_weights, manifest_wrong_hash, manifest_unlisted_file,
              manifest_missing_file, manifest_graph_io_mismatch, external_data_dotdot,
              external_data_absolute, symlinked_file, symlinked_directory, *REHASHED]


def _writable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    return dst


_WITH_PEAK = """
import atexit, runpy, sys
from kvserve.bench.common import proc_memory
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(str(proc_memory()["VmHWM"])))
sys.argv[0] = "kvserve"
runpy.run_module("kvserve.cli", run_name="__main__")
"""


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
        hwm = port_file.with_name("vmhwm")
        # kvserve serve, which writes its own peak RSS (VmHWM) to a file as it exits
        # (bench.common.proc_memory says why not ru_maxrss)
        cmd = [sys.executable, "-c", _WITH_PEAK, str(hwm), *serve_cmd(root, port_file)[3:]]
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "KVSERVE_LOG_LEVEL": "WARNING"})
        return name, (p.returncode, p.stderr, parts, port_file, time.monotonic() - t0,
                      int(hwm.read_text()), root)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(pool.map(run, jobs.items()))


@pytest.mark.parametrize("name", [fn.__name__ for fn in TAMPERINGS])
def test_serve_refuses_tampered_artifact(refusals, name):
    rc, err, parts, port_file, seconds, peak, _ = refusals[name]
    assert rc == 1, err
    assert err.startswith("kvserve serve: refusing to serve") and len(err.splitlines()) == 1, err
    for part in parts:
        assert part in err, (part, err)
    assert "Traceback" not in err
    assert not port_file.exists()  # it never served
    # before the fix a hostile config was sized from: 7-30 s of allocation (GBs), or a
    # traceback. What is held to is the memory (the whole process, imports included, peaks at
    # 86-92 MB here); the time only as a guard against a hang (measured 0.9-1.7 s two at a
    # time, up to 3.5 s with the machine's two cores busy elsewhere; the target is 2 s alone)
    assert peak < 400e6, peak
    assert seconds < 20, seconds


@pytest.mark.parametrize("name", [fn.__name__ for fn in REHASHED])
def test_verify_refuses_rehashed_tampering(refusals, name, capsys):
    *_, root = refusals[name]
    assert cli.main(["verify", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvserve verify: FAILED: ") and len(err.splitlines()) == 1, err
    for part in refusals[name][2]:
        assert part in err, (part, err)


@pytest.mark.parametrize("name", ["config_n_layers_1e9", "config_n_heads_not_the_graphs",
                                  "manifest_deeply_nested"])
def test_no_verify_still_checks_what_buffers_are_sized_from(refusals, name, tmp_path):
    """--no-verify skips the hashes and onnx.checker, not the schema and config checks."""
    *_, root = refusals[name]
    p = subprocess.run(serve_cmd(root, tmp_path / "port.json", "--no-verify"),
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KVSERVE_LOG_LEVEL": "WARNING"})
    assert p.returncode == 1 and p.stderr.startswith("kvserve serve: refusing to serve"), p.stderr
    assert refusals[name][2][0] in p.stderr


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

"""The llama.cpp peer's weights: a bench model's Hugging Face directory as GGUF (f32, then q8_0 /
q4_0), made with the tools llama-cpp-python's own source distribution vendors.

  convert   ``convert_hf_to_gguf.py`` (vendor/llama.cpp) with its vendored ``gguf-py``: the
            bench tokenizers are kvserve's byte-level BPE (``pre_tokenizers.ByteLevel``, the
            GPT-2 split regex), whose hash the script does not list, so the script is told
            "gpt-2" (what that pre-tokenizer is); the bench feeds token ids, never text. (Its
            SentencePiece attempt is skipped where there is no tokenizer.model: sentencepiece
            is not needed.)
  quantize  ``llama_cpp.llama_model_quantize`` (q8_0, q4_0) from the f32 file

Each runs in a subprocess (``python -m kvserve.bench.gguf_convert convert|quantize ...``) so a
native crash cannot take the orchestrator with it. ``gguf_files`` builds what is missing,
each file written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import importlib.metadata as md
import logging
import os
import subprocess
import sys
import tarfile
from pathlib import Path

log = logging.getLogger(__name__)

FTYPES = {"q8_0": 7, "q4_0": 2}  # llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0 / _Q4_0
SRC_ENV = "KVSERVE_LLAMACPP_SRC"  # an unpacked llama-cpp-python sdist (or its llama.cpp dir)
KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def llamacpp_source(cache: Path) -> Path:
    """vendor/llama.cpp of the installed llama-cpp-python's sdist: ``$KVSERVE_LLAMACPP_SRC``,
    or the sdist of the installed version fetched once by pip into the cache (only the
    converter's files are unpacked)."""
    env = os.environ.get(SRC_ENV)
    if env:
        p = Path(env)
        return p / "vendor" / "llama.cpp" if (p / "vendor" / "llama.cpp").is_dir() else p
    ver = md.version("llama-cpp-python")
    root = cache / "llamacpp-src" / ver
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    dl = cache / "llamacpp-src" / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"llama-cpp-python=={ver}", "-d", str(dl)],
                       capture_output=True, text=True)
    tars = sorted(dl.glob(f"llama_cpp_python-{ver}.tar.gz"))
    if r.returncode != 0 or not tars:
        raise RuntimeError(f"cannot fetch the llama-cpp-python {ver} sdist (set {SRC_ENV}): "
                           f"{r.stderr.strip()[-300:]}")
    tmp = root.with_name(f".{ver}.tmp-{os.getpid()}")
    prefix = f"llama_cpp_python-{ver}/vendor/llama.cpp/"
    with tarfile.open(tars[0]) as t:
        members = [m for m in t.getmembers() if m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(KEEP) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(prefix):]
        t.extractall(tmp, members=members, filter="data")
    tmp.rename(root)
    return root


def convert(src: Path, hf: Path, out: Path, outtype: str = "f32") -> None:
    """(In this process: the subprocess's body.)"""
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    import conversion.base as base  # noqa: E402 (vendored with the script)

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sp = base.TextModel._set_vocab_sentencepiece

    def no_sentencepiece(self, *a, **kw):  # (it imports sentencepiece before looking for the
        # file; without tokenizer.model the script goes on to the BPE vocab)
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError("no tokenizer.model")
        return sp(self, *a, **kw)

    base.TextModel._set_vocab_sentencepiece = no_sentencepiece
    import convert_hf_to_gguf as c  # noqa: E402

    sys.argv = ["convert_hf_to_gguf.py", str(hf), "--outfile", str(out), "--outtype", outtype]
    c.main()


def quantize(src: Path, out: Path, kind: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")


def _run(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kvserve.bench.gguf_convert", *args],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"gguf_convert {args[0]} failed ({r.returncode}): "
                           f"{(r.stderr or r.stdout).strip()[-1500:]}")


def gguf_files(hf: Path, out_dir: Path, cache: Path, kinds=("f32", "q8_0", "q4_0")
               ) -> dict[str, Path]:
    """kind -> GGUF file of ``hf``'s weights (built where missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    f32 = out_dir / "model-f32.gguf"
    if not f32.is_file():
        tmp = f32.with_suffix(".tmp")
        _run("convert", str(llamacpp_source(cache)), str(hf), str(tmp))
        tmp.rename(f32)
    files = {"f32": f32}
    for kind in kinds:
        if kind == "f32":
            continue
        q = out_dir / f"model-{kind}.gguf"
        if not q.is_file():
            tmp = q.with_suffix(".tmp")
            _run("quantize", str(f32), str(tmp), kind)
            tmp.rename(q)
        files[kind] = q
    return files


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    op, *rest = sys.argv[1:]
    if op == "convert":
        convert(Path(rest[0]), Path(rest[1]), Path(rest[2]))
    elif op == "quantize":
        quantize(Path(rest[0]), Path(rest[1]), rest[2])
    else:
        raise SystemExit(f"unknown op {op!r}")

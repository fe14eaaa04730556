"""Build (or reuse) the benchmark models: one set of random-init weights per size, shared by
every runner.

Per size, under ``<cache>/<name>/``:
  hf/         LlamaForCausalLM(LlamaConfig(...)) with a fixed seed, safetensors, plus a trained
              byte-level BPE tokenizer.json of the model's vocab size (transformers reads it,
              the onnxruntime-genai builder needs it)
  ckpt/       ``kvserve import-hf hf/``
  fp32/       ``export_artifacts(ckpt, precision="fp32")`` (prefill + decode graphs)
  int8/       ``export_artifacts(ckpt, precision="int8", int8_block=64)`` (sizes that ask for
              it): 8-bit blocks of 64 store 8.5 bits a weight, llama.cpp q8_0's size
  int4/       ``export_artifacts(ckpt, precision="int4", int4_block=64)`` (when the llama.cpp
              peer's q4_0 runs): blocks of 64 store 4.5 bits a weight, q4_0's size
  gguf/       llama.cpp's copies of hf/ (``bench/gguf_convert.py``; when llama.cpp runs)
  genai/      ``python -m onnxruntime_genai.models.builder -i hf -o genai -p fp32 -e cpu``
Every step writes into a temporary directory and renames it into place, so a directory that
exists is complete and a rerun skips it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SEED = 1234


@dataclass(frozen=True)
class Size:
    name: str  # the kvserve preset it matches
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    tie: bool = False
    int8: bool = False
    label: str = ""

    def hf_config(self, eos: int | None = None, pad: int | None = None) -> dict:
        return dict(vocab_size=self.vocab, hidden_size=self.d_model,
                    intermediate_size=self.d_ff, num_hidden_layers=self.n_layers,
                    num_attention_heads=self.n_heads, num_key_value_heads=self.n_kv_heads,
                    max_position_embeddings=self.max_seq_len, rms_norm_eps=1e-5,
                    rope_theta=10000.0, tie_word_embeddings=self.tie, hidden_act="silu",
                    bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)


def _from_preset(name: str, **kw) -> Size:
    from kvserve.model.config import PRESETS

    p = PRESETS[name]
    return Size(name=name, vocab=p["vocab_size"], d_model=p["d_model"], n_layers=p["n_layers"],
                n_heads=p["n_heads"], n_kv_heads=p["n_kv_heads"], d_ff=p["d_ff"],
                max_seq_len=p["max_seq_len"], **kw)


def sizes() -> dict[str, Size]:
    return {
        "bench-6m": _from_preset("bench-6m", label="6M (d256, 4L, 8/2 heads, V4096)"),
        "bench-100m": _from_preset("bench-100m", int8=True,
                                   label="100M (d768, 12L, 12/4 heads, V16384)"),
        # the project's default preset: tied embeddings, d_ff 768
        "small": _from_preset("small", tie=True, label="small preset (d256, 4L, tied)"),
    }


@dataclass
class Built:
    size: Size
    root: Path
    hf: Path
    ckpt: Path
    fp32: Path
    int8: Path | None
    genai: Path | None
    build_seconds: dict = field(default_factory=dict)
    int4: Path | None = None


# --- tokenizer ---------------------------------------------------------------------------------
def _stdlib_texts(max_bytes: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            t = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(t)
        total += len(t)
        if total >= max_bytes:
            break
    return out


def tokenizer_json(cache: Path, vocab: int) -> Path:
    """A byte-level BPE with ``vocab`` tokens (kvserve's own trainer), cached per size."""
    path = cache / "tokenizers" / f"bpe-{vocab}.json"
    if path.is_file():
        return path
    from kvserve.model.tokenizer import train_bpe

    t0 = time.perf_counter()
    # enough text for the merges to reach the vocab size
    texts = _stdlib_texts(max_bytes=max(1_000_000, vocab * 300))
    tok = train_bpe(texts, vocab_size=vocab, min_frequency=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(tmp)
    tmp.replace(path)
    log.info("tokenizer %d (got %d) in %.1fs", vocab, tok.vocab_size, time.perf_counter() - t0)
    return path


# --- the steps ---------------------------------------------------------------------------------
def _atomic_dir(final: Path):
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def build_hf(size: Size, cache: Path, out: Path, seed: int = SEED) -> Path:
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers as tf
    from kvserve.model.tokenizer import Tokenizer

    tok_path = tokenizer_json(cache, size.vocab)
    tok = Tokenizer.from_file(tok_path)
    tmp = _atomic_dir(out)
    cfg = tf.LlamaConfig(**size.hf_config(eos=tok.eos_id, pad=tok.pad_id))
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(str(tmp), safe_serialization=True)
    fast = tf.PreTrainedTokenizerFast(tokenizer_file=str(tok_path), eos_token="<|endoftext|>",
                                      bos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(str(tmp))
    shutil.copy(tok_path, tmp / "tokenizer.json")  # exactly the trained one
    tmp.rename(out)
    return out


def build_ckpt(hf: Path, out: Path) -> Path:
    if (out / "model.safetensors").is_file():
        return out
    from kvserve.model.hf_import import import_hf

    tmp = _atomic_dir(out)
    import_hf(hf, tmp)
    tmp.rename(out)
    return out


def code_stamp() -> str:
    """Fingerprint of the code an artifact is made by (model/, export/, the artifact spec and
    manifest): a change there makes the cached artifacts stale."""
    import hashlib

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    # the artifact contract (spec, manifest) shapes what export writes; its runners do not
    files = [p for pkg in ("model", "export") for p in sorted((root / pkg).glob("*.py"))]
    files += [root / "artifact" / "spec.py", root / "artifact" / "manifest.py"]
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


STAMP = ".bench-stamp"


# the bench's int4 artifact: blocks of 64 weights with a float32 scale each store 4.5 bits a
# weight, as llama.cpp's q4_0 (blocks of 32, a float16 scale each) that it is measured against;
# kvserve's default (32) stores 5 (bench/results/int4-blocks.md measures both)
BENCH_INT4_BLOCK = 64
# the bench's int8 artifact: 8-bit MatMulNBits blocks of 64 (8.5 bits a weight), as llama.cpp's
# q8_0 (blocks of 32, a float16 scale each); kvserve's default int8 (per-row activations in
# standard ops, the same logits in any batch) is measured beside it in
# bench/results/int8-blocks.md
BENCH_INT8_BLOCK = 64


def build_artifacts(ckpt: Path, out: Path, precision: str, threads: int = 2,
                    int4_block: int | None = None, eval_text: Path | None = None, *,
                    int8_block: int | None = None, paired: bool = False) -> Path:
    """``eval_text``: the text of the manifest's perplexity figures (default: the export's);
    ``int8_block``: an int8 artifact in 8-bit blocks (None: kvserve's default, per-row);
    ``paired``: ``kvserve export --paired-attention``."""
    stamp = code_stamp() + (f":int4-block-{int4_block}" if int4_block else "") \
        + (f":int8-block-{int8_block}" if int8_block else "") \
        + (":paired" if paired else "") \
        + (f":eval-{Path(eval_text).name}" if eval_text else "")
    if (out / "manifest.json").is_file():
        if (out.parent / f"{out.name}{STAMP}").is_file() and \
                (out.parent / f"{out.name}{STAMP}").read_text() == stamp:
            return out
        log.info("%s was made by other model/export code: rebuilding", out)
        shutil.rmtree(out)
    from kvserve.export.pipeline import export_artifacts

    # attention diagnostics graphs are not benchmarked; the perplexity gate is reported, not
    # enforced (random-init weights: perplexity ~ vocab size)
    out = Path(export_artifacts(ckpt, out, precision=precision, attention=False,
                                parity_steps=64, max_ppl_increase=10.0, progress=False,
                                threads=threads, int4_block=int4_block,
                                int8_block=int8_block, eval_text=eval_text, paired=paired))
    # beside the artifact, not in it: the manifest lists every file of the directory
    (out.parent / f"{out.name}{STAMP}").write_text(stamp)
    return out


def build_genai(hf: Path, out: Path, threads: int = 2) -> Path:
    if (out / "genai_config.json").is_file():
        return out
    tmp = _atomic_dir(out)
    cache = out.parent / ".genai-cache"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o",
           str(tmp), "-p", "fp32", "-e", "cpu", "-c", str(cache)]
    r = subprocess.run(cmd, capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if r.returncode != 0 or not (tmp / "genai_config.json").is_file():
        raise RuntimeError(f"onnxruntime-genai builder failed ({r.returncode}):\n"
                           f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    set_genai_threads(tmp, threads)
    shutil.rmtree(cache, ignore_errors=True)
    tmp.rename(out)
    return out


def set_genai_threads(genai_dir: Path, threads: int) -> None:
    """Same intra-op thread count as every other runner."""
    p = genai_dir / "genai_config.json"
    cfg = json.loads(p.read_text())
    so = cfg["model"]["decoder"].setdefault("session_options", {})
    so["intra_op_num_threads"] = threads
    so["inter_op_num_threads"] = 1
    p.write_text(json.dumps(cfg, indent=4))


def build(name: str, cache: Path, *, genai: bool = True, int8: bool | None = None,
          int4: bool = False, threads: int = 2) -> Built:
    size = sizes()[name]
    root = cache / "models" / name
    root.mkdir(parents=True, exist_ok=True)
    secs = {}

    def step(label, fn, *a, **kw):
        t0 = time.perf_counter()
        r = fn(*a, **kw)
        dt = time.perf_counter() - t0
        if dt > 0.5:
            secs[label] = round(dt, 1)
            log.info("built %s/%s in %.1fs", name, label, dt)
        return r

    hf = step("hf", build_hf, size, cache, root / "hf")
    ckpt = step("ckpt", build_ckpt, hf, root / "ckpt")
    fp32 = step("fp32", build_artifacts, ckpt, root / "fp32", "fp32", threads)
    want_int8 = size.int8 if int8 is None else int8
    q = step("int8", build_artifacts, ckpt, root / "int8", "int8", threads,
             int8_block=BENCH_INT8_BLOCK) if want_int8 else None
    q4 = step("int4", build_artifacts, ckpt, root / "int4", "int4", threads,
              BENCH_INT4_BLOCK) if int4 else None
    g = step("genai", build_genai, hf, root / "genai", threads) if genai else None
    return Built(size, root, hf, ckpt, fp32, q, g, secs, q4)

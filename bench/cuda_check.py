"""The CUDA check (``kvserve bench --provider cuda``): the fused runtime on a GPU against the CPU
provider and against transformers on the same weights.

Per benchmark size (default bench-6m; bench-100m when the machine can build it), per precision
(fp32 and fp16; int8 / int4 where their artifacts are found):
  1. correctness: teacher-forced logits, device vs CPU on the same artifact, over ``rows`` x
     ``steps`` (the CPU's greedy tokens fed to both), max |Δlogit| (fp32 with TF32 off:
     target <= 1e-4; the other precisions' kernels round apart: a figure), and greedy tokens
     generated independently on each provider;
  2. the serving path (``cuda_engine``): the engine's speed features (prefix cache,
     speculation, interleaved prefill) on vs off over one workload, tokens equal and logprobs
     within 1e-4; batch-1 tok/s and step(1000) / step(16) at batch 16;
then fp16's perplexity change against fp32 (target <= 1%), and on the first precision the
device runs: ``kvserve serve`` on the provider (a request's tokens over gRPC equal to the
in-process engine's), batch-1 tok/s against transformers eager fp32 on the device (target
>= 3x), the engine's features' figures there (speculation on a repeating prompt, a cached
prefix's time to first token, engine vs loop at batch 1 and 8).
Artifacts already under ``--cache``/models/<size>/ (fp32/, fp16/) are used as they are (made
here and carried to a GPU machine); missing ones are built. Each section's result (or the
error it raised) is written to ``--out`` as soon as it is known. ``--provider cpu`` runs the
same logic on the CPU against itself (a smoke test of this script on machines without a GPU;
its figures say nothing about CUDA).
CUDA graphs (``enable_cuda_graph``) are not used: the decode step's shapes (batch, the
attention length through ``total_sequence_length``) change every step, which a captured graph
cannot follow without fixed-capacity buckets; left for later, off.
"""
from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def _lm(art: Path, provider: str, threads: int):
    from kvserve.artifact.loader import load_lm

    return load_lm(art, provider=provider, threads=threads, attention=False)


def teacher_forced(ref, dev, prompts: np.ndarray, steps: int) -> dict:
    """ref, dev: runners; the reference's greedy tokens drive both."""
    B = len(prompts)
    kr, kd = ref.new_cache(B), dev.new_cache(B)
    lr = ref.prefill(kr, 0, list(prompts)).logits
    ld = dev.prefill(kd, 0, list(prompts)).logits
    worst = max(float(np.abs(a - b).max()) for a, b in zip(lr, ld))
    tok = np.array([x[-1].argmax() for x in lr], np.int64)
    for _ in range(steps):
        a, _ = ref.decode(kr, B, tok)
        a = a.copy()
        b, _ = dev.decode(kd, B, tok)
        worst = max(worst, float(np.abs(a - b).max()))
        tok = a.argmax(-1)
    return {"rows": B, "steps": steps, "max_abs_logit": worst}


def greedy(lm, prompts: np.ndarray, steps: int) -> np.ndarray:
    B = len(prompts)
    kv = lm.new_cache(B)
    tok = np.array([x[-1].argmax() for x in lm.prefill(kv, 0, list(prompts), last=True).logits])
    out = [tok]
    for _ in range(steps - 1):
        tok = lm.decode(kv, B, tok)[0].argmax(-1)
        out.append(tok)
    return np.stack(out, 1)


def tok_per_s(lm, prompts: np.ndarray, n: int, repeats: int = 3) -> float:
    from .runners import best_of

    best, _ = best_of(lambda: greedy(lm, prompts, n), repeats, min_total=0.0)
    return len(prompts) * n / best


def step_ms(lm, batch: int, position: int, vocab: int, steps: int = 32) -> float:
    rng = np.random.default_rng(7)
    kv = lm.new_cache(batch, capacity=position + 8)
    lm.prefill(kv, 0, list(rng.integers(2, vocab, (batch, position))))
    tok = np.full(batch, 5, np.int64)
    dts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        lm.decode(kv, batch, tok)
        dts.append(time.perf_counter() - t0)
        kv.used[:batch] -= 1  # rewind: every step runs at ``position``
    return 1000 * statistics.median(dts)


def hf_tok_per_s(hf_dir: Path, prompts: np.ndarray, n: int, device: str) -> float:
    import torch
    import transformers as tf

    model = tf.LlamaForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager",
                                                dtype=torch.float32).to(device).eval()
    x = torch.tensor(prompts, device=device)
    best = float("inf")
    with torch.no_grad():
        for _ in range(3):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=1)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    return len(prompts) * n / best


def _artifacts(name: str, cache: Path, threads: int) -> tuple:
    """(size, the fp32 and fp16 artifacts, a maker of the transformers copy): artifacts found
    under ``cache/models/<name>/`` are used as they are (made on another machine and carried
    to the GPU one), the missing ones built here."""
    from . import build as B

    size, root = B.sizes()[name], cache / "models" / name

    def hf() -> Path:
        return B.build_hf(size, cache, root / "hf")

    def made(precision: str) -> Path:
        d = root / precision
        if (d / "manifest.json").is_file():
            return d
        return B.build_artifacts(B.build_ckpt(hf(), root / "ckpt"), d, precision, threads)
    return size, made("fp32"), made("fp16"), hf


def _section(out: dict, key: str, save, fn, *a, **kw) -> None:
    """``out[key] = fn(...)``, or the error it raised (the check goes on to the next section);
    the results so far are saved after each section."""
    t0 = time.perf_counter()
    try:
        out[key] = fn(*a, **kw)
    except Exception as e:  # a check reports what broke and carries on
        log.exception("%s failed", key)
        out[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    if isinstance(out[key], dict):
        out[key]["seconds"] = round(time.perf_counter() - t0, 1)
    save()


def _correctness(cpu, dev, vocab: int, rows: int, steps: int) -> dict:
    prompts = np.random.default_rng(3).integers(2, vocab, (rows, 32))
    same = greedy(cpu, prompts, steps) == greedy(dev, prompts, steps)
    return {"teacher_forced": teacher_forced(cpu, dev, prompts, steps),
            "greedy": {"rows": rows, "steps": steps, "equal": bool(same.all()),
                       "agreement": float(same.mean())}}


def _precision(art: Path, provider: str, threads: int, vocab: int, rows: int, steps: int
               ) -> dict:
    """An artifact on the device against the same artifact on the CPU (exact for fp32 with
    TF32 off; quantized and fp16 kernels round apart: a figure), the engine's features on it
    (on by default where its rows do not round with the call's shape), its batch-1 speed."""
    from . import cuda_engine as E

    cpu, dev = _lm(art, "cpu", threads), _lm(art, provider, threads)
    out = _correctness(cpu, dev, vocab, rows, steps)
    out["provider"] = dev.provider
    out["engine_exactness"] = E.exactness(art, provider, threads)
    one = np.random.default_rng(3).integers(2, vocab, (1, 32))
    out["bs1_tok_s"] = tok_per_s(dev, one, 128)
    far = min(1000, dev.cfg.max_seq_len - 40)  # (a tiny test model's context is shorter)
    out["step_ms_bs16"] = {str(p): step_ms(dev, 16, p, vocab) for p in (16, far)}
    return out


def _fp16(fp32: Path, fp16: Path, provider: str, threads: int, vocab: int) -> dict:
    """fp16 on the device against fp32 on the CPU: the perplexity of a random text."""
    from kvserve.export.precision import perplexity

    ids = np.random.default_rng(5).integers(2, vocab, 1024).tolist()
    p32 = perplexity(_lm(fp32, "cpu", threads), ids, 512)
    p16 = perplexity(_lm(fp16, provider, threads), ids, 512)
    return {"fp32_cpu": p32, "fp16": p16, "relative_change": p16 / p32 - 1.0}


def _vs_transformers(art: Path, hf, provider: str, threads: int, vocab: int) -> dict:
    one = np.random.default_rng(3).integers(2, vocab, (1, 32))
    s = {"artifact": art.name, "kvserve_bs1_tok_s": tok_per_s(_lm(art, provider, threads),
                                                              one, 128),
         "transformers_eager_fp32_bs1_tok_s": hf_tok_per_s(
             hf(), one, 128, "cuda" if provider == "cuda" else "cpu")}
    s["ratio"] = s["kvserve_bs1_tok_s"] / s["transformers_eager_fp32_bs1_tok_s"]
    return s


QUANTIZED = ("int8", "int4")
# artifacts measured where found under the size's directory (made elsewhere and carried: a
# GPU machine's export may differ): the quantized ones, and the portable (standard-op)
# graphs, which run on any provider that has their ops
FOUND = (*QUANTIZED, "portable")


def check_size(name: str, cache: Path, provider: str, threads: int, rows: int, steps: int,
               save=lambda: None, out: dict | None = None) -> dict:
    """The size's sections into ``out`` (saved after each by ``save``): each precision found
    (fp32 and fp16 built when missing; int8 / int4 where carried), then fp16's perplexity,
    the served path, the speed against transformers and the engine's features' figures, the
    last three on the first precision the device runs."""
    from . import cuda_engine as E

    out = {} if out is None else out
    out["size"] = name
    size, fp32, fp16, hf = _artifacts(name, cache, threads)
    V = size.vocab
    arts = [fp32, fp16] + [cache / "models" / name / q for q in FOUND
                           if (cache / "models" / name / q / "manifest.json").is_file()]
    for art in arts:
        _section(out, art.name, save, _precision, art, provider, threads, V, rows, steps)
    _section(out, "fp16_perplexity", save, _fp16, fp32, fp16, provider, threads, V)
    runs = [a for a in (fp32, fp16) if "error" not in out[a.name]]
    if runs:
        _section(out, "server", save, E.server, runs[0], provider, threads)
        _section(out, "vs_transformers", save, _vs_transformers, runs[0], hf, provider,
                 threads, V)
        _section(out, "engine_speed", save, E.speed, runs[0], provider, threads)
        _section(out, "engine_repeatability", save, E.repeatability, runs[0], provider,
                 threads)
    out["targets"] = _targets(out)
    save()
    return out


def _targets(out: dict) -> dict:
    def get(*path):
        x = out
        for k in path:
            if not isinstance(x, dict) or k not in x:
                return None
            x = x[k]
        return x

    def le(v, bound):
        return None if v is None else v <= bound
    fp16 = get("fp16_perplexity", "relative_change")
    steps = sorted((int(k), v) for k, v in (get("fp32", "step_ms_bs16") or {}).items())
    return {
        "greedy_equal_fp32": get("fp32", "greedy", "equal"),
        "teacher_forced_fp32_le_1e-4": le(get("fp32", "teacher_forced", "max_abs_logit"), 1e-4),
        "fp16_ppl_change_le_1pct": None if fp16 is None else abs(fp16) <= 0.01,
        **{f"engine_features_exact_{p}": get(p, "engine_exactness", "ok")
           for p in ("fp32", "fp16", *FOUND) if p in out},
        "served_equals_in_process": get("server", "tokens_equal"),
        "bs1_ge_3x_transformers": None if get("vs_transformers", "ratio") is None
        else get("vs_transformers", "ratio") >= 3.0,
        "step_ratio_bs16_fp32_le_1.2": le(steps[-1][1] / steps[0][1], 1.2) if steps else None,
    }


def _versions() -> dict:
    """The versions that ran (onnxruntime's from the module: a GPU machine may hold both
    onnxruntime-gpu and a CPU onnxruntime's metadata), and the GPU's name."""
    import onnxruntime as ort

    from .common import machine, versions

    v = {**versions(), "onnxruntime": ort.__version__, "machine": machine(),
         "providers": ort.get_available_providers()}
    try:
        import torch

        if torch.cuda.is_available():
            v["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return v


def add_arguments(parser) -> None:
    parser.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--sizes", default="bench-6m")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", default=".bench")
    parser.add_argument("--out", required=True, help="JSON file to write")


def run(sizes: str, cache: Path, threads: int, out: Path, provider: str = "cuda",
        rows: int = 16, steps: int = 128) -> int:
    """``kvserve bench --provider cuda``."""
    import argparse

    return main(argparse.Namespace(provider=provider, sizes=sizes, rows=rows, steps=steps,
                                   threads=threads, cache=str(cache), out=str(out)))


def main(args) -> int:
    if args.provider == "cuda":
        import onnxruntime as ort

        try:  # the CUDA/cuDNN libraries of the image (torch's), before a CUDA session
            import torch  # noqa: F401
        except ImportError:
            ort.preload_dlls()
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            print("cuda check: onnxruntime has no CUDAExecutionProvider here", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict = {"provider": args.provider, "versions": _versions(), "sizes": [],
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def save() -> None:
        out.write_text(json.dumps(res, indent=1) + "\n")
    for name in args.sizes.split(","):
        res["sizes"].append({"size": name})
        try:
            check_size(name, Path(args.cache), args.provider, args.threads, args.rows,
                       args.steps, save, res["sizes"][-1])
        except Exception as e:  # (building the size's artifacts): the next size still runs
            log.exception("%s failed", name)
            res["sizes"][-1]["error"] = f"{type(e).__name__}: {e}"[:2000]
        save()
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(ap.parse_args()))

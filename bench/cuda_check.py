"""The CUDA check (``kvserve bench --provider cuda``): the fused runtime on a GPU against the CPU
provider and against transformers on the same weights.

Per benchmark size (default bench-6m; bench-100m when the machine can build it):
  1. correctness, fp32 with TF32 off: teacher-forced logits, CUDA vs CPU, over ``rows`` x
     ``steps`` (the CPU's greedy tokens fed to both), max |Δlogit| (target <= 1e-4); and greedy
     tokens generated independently on each provider, equal?
  2. fp16 on CUDA (float16 KV cache): perplexity of a text vs fp32 (target change <= 1%);
  3. speed: batch-1 tok/s of the fused loop vs transformers eager on CUDA (target >= 3x) and
     step(1000) / step(16) at batch 16 (target <= 1.2).
Writes JSON to ``--out``. ``--provider cpu`` runs the same logic on the CPU against itself (a
smoke test of this script on machines without a GPU; its figures say nothing about CUDA).
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
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        greedy(lm, prompts, n)
        best = min(best, time.perf_counter() - t0)
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


def check_size(name: str, cache: Path, provider: str, threads: int, rows: int, steps: int
               ) -> dict:
    from kvserve.export.precision import perplexity

    from . import build as B

    built = B.build(name, cache, genai=False, int8=False, threads=threads)
    fp16 = B.build_artifacts(built.ckpt, built.root / "fp16", "fp16", threads)
    vocab = built.size.vocab
    prompts = np.random.default_rng(3).integers(2, vocab, (rows, 32))
    cpu = _lm(built.fp32, "cpu", threads)
    dev = _lm(built.fp32, provider, threads)
    out: dict = {"size": name, "device_provider": dev.provider}
    out["teacher_forced_fp32"] = teacher_forced(cpu, dev, prompts, steps)
    same = greedy(cpu, prompts, steps) == greedy(dev, prompts, steps)
    out["greedy_fp32"] = {"rows": rows, "steps": steps, "equal": bool(same.all()),
                          "agreement": float(same.mean())}
    ids = np.random.default_rng(5).integers(2, vocab, 1024).tolist()
    dev16 = _lm(fp16, provider, threads)
    p32, p16 = perplexity(dev, ids, 512), perplexity(dev16, ids, 512)
    out["fp16_perplexity"] = {"fp32": p32, "fp16": p16, "relative_change": p16 / p32 - 1.0}
    one = prompts[:1]
    out["speed"] = {
        "kvserve_bs1_tok_s": tok_per_s(dev, one, 128),
        "kvserve_fp16_bs1_tok_s": tok_per_s(dev16, one, 128),
        "transformers_eager_bs1_tok_s": hf_tok_per_s(
            built.hf, one, 128, "cuda" if provider == "cuda" else "cpu"),
        "step_ms_bs16": {str(p): step_ms(dev, 16, p, vocab) for p in (16, 1000)},
    }
    s = out["speed"]
    s["ratio_vs_transformers"] = s["kvserve_bs1_tok_s"] / s["transformers_eager_bs1_tok_s"]
    s["step_ratio_bs16"] = s["step_ms_bs16"]["1000"] / s["step_ms_bs16"]["16"]
    out["targets"] = {
        "greedy_equal": out["greedy_fp32"]["equal"],
        "teacher_forced_le_1e-4": out["teacher_forced_fp32"]["max_abs_logit"] <= 1e-4,
        "fp16_ppl_change_le_1pct": abs(out["fp16_perplexity"]["relative_change"]) <= 0.01,
        "bs1_ge_3x_transformers": s["ratio_vs_transformers"] >= 3.0,
        "step_ratio_bs16_le_1.2": s["step_ratio_bs16"] <= 1.2,
    }
    return out


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
    res = {"sizes": [check_size(n, Path(args.cache), args.provider, args.threads, args.rows,
                                args.steps) for n in args.sizes.split(",")]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(ap.parse_args()))

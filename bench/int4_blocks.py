"""What the int4 block size buys and costs (a script): speed against fidelity.

    python bench/int4_blocks.py [--size bench-100m | trained] [--blocks 32 64 128] [--rounds 7]
                                [--update-committed | --out FILE.json] [--render-only]

The size's checkpoint (``bench/build.py``: random-init Llama, built when missing) is exported
int4 once per block size (``kvserve export --precision int4 --int4-block-size N``, cached
under ``<cache>/models/<size>/int4-bN``). For each artifact:

- what it stores: bits a weight (4 + 32 / N: one float32 scale per block) and its data file;
- fidelity, from its manifest (the export's own gate against the fp32 torch model): max
  |Δlogit| over prefill and 64 decode steps, greedy token agreement, relative perplexity change
  on the held-out text (on random-init weights these are rough: every artifact is judged on the
  same prompts and text, so they compare the block sizes, not the model);
- speed: the raw decode loop (``bench/runner_kvserve.LoopRunner``: prefill 32 random tokens,
  then 64 greedy steps) at batch 1 and 8, every artifact loaded in one process and timed in
  alternating rounds; the ratio to the first block size is the median of the per-round ratios.

Results: ``int4-blocks.json`` (one entry a size; a run replaces its size's) and
``int4-blocks.md`` (``--update-committed``: ``bench/results/``; docs/export.md quotes them).
``--size trained``: the default trained model (``bench/trained.py``, trained once into the
cache), whose perplexity is taken on held-out files: the fidelity figures that mean most.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from kvserve.bench.common import CACHE, RESULTS, cpu_model

NEW_TOKENS = 64
HELD_OUT = 8  # held-out files of the trained model's perplexity text


def build(size: str, cache: Path, blocks: list[int]) -> dict[int, Path]:
    """The size's int4 artifacts, one per block size. ``trained``: the default trained model
    (``bench/trained.py``), its perplexity taken on held-out files (neither its weights nor its
    tokenizer saw them); the random-init sizes: on the export's default text."""
    from kvserve.bench.build import build as build_size, build_artifacts

    eval_text = None
    if size == "trained":
        from kvserve.bench.trained import build_trained, held_out_files

        built = build_trained(cache, genai=False)
        eval_text = built.root / "held-out.txt"
        if not eval_text.is_file():
            eval_text.write_text("\n".join(f.read_text(errors="replace")
                                           for f in held_out_files()[:HELD_OUT]))
    else:
        built = build_size(size, cache, genai=False, int8=False)
    return {b: build_artifacts(built.ckpt, built.root / f"int4-b{b}", "int4", int4_block=b,
                               eval_text=eval_text)
            for b in blocks}


def fidelity(art: Path) -> dict:
    m = json.loads((art / "manifest.json").read_text())
    q, ppl = m["parity"]["int4"], m.get("perplexity", {})
    return {"block_size": m["quantization"]["block_size"],
            "bits_per_weight": m["quantization"]["bits_per_weight"],
            "data_mb": (art / "model.onnx.data").stat().st_size / 2**20,
            "max_abs_logit": max(q["max_abs_logit_prefill"], q["max_abs_logit_decode"]),
            "token_agreement": q["token_agreement"],
            "perplexity_change": ppl.get("relative_change")}


def speed(arts: dict[int, Path], batches: list[int], rounds: int, threads: int) -> dict:
    from kvserve.bench.runner_base import prompts_for
    from kvserve.bench.runner_kvserve import LoopRunner

    runners = {b: LoopRunner(str(a), threads) for b, a in arts.items()}
    vocab = next(iter(runners.values())).cfg.vocab_size
    out: dict = {}
    for B in batches:
        prompts = prompts_for(B, 32, vocab)
        for r in runners.values():
            r.generate(prompts, 4)  # (first runs: bindings, onnxruntime's own warm-up)
        tok_s: dict[int, list[float]] = {b: [] for b in runners}
        for _ in range(rounds):
            for b, r in runners.items():
                time.sleep(0.2)  # the previous runner's threads stop spinning
                t0 = time.perf_counter()
                r.generate(prompts, NEW_TOKENS)
                tok_s[b].append(B * NEW_TOKENS / (time.perf_counter() - t0))
        first = next(iter(tok_s))
        out[str(B)] = {str(b): {"tok_s": float(np.median(v)), "rounds": [round(x, 1) for x in v],
                                "vs_first": float(np.median(np.array(v) / tok_s[first]))}
                       for b, v in tok_s.items()}
    return out


def render(res: dict) -> str:
    blocks = [str(f["block_size"]) for f in res["artifacts"]]
    first = blocks[0]
    lines = [f"## int4 block size: speed and fidelity ({res['size']})", "",
             f"{res['cpu']}, {res['threads']} onnxruntime threads, onnxruntime "
             f"{res['onnxruntime']}; {res['date']}. Raw decode loop, {NEW_TOKENS} greedy tokens "
             f"after 32 random ones, medians of {res['rounds']} alternating rounds; fidelity "
             f"from each export's gate against the fp32 torch model"
             + (f" (the default trained model: perplexity on {HELD_OUT} held-out files, "
                f"neither trained on nor in its tokenizer's corpus, their first 4,096 tokens)"
                if res["size"] == "trained" else
                " (random-init weights: compare the rows, not the model)")
             + ". Data MB: the weights file (the embedding table stays float32).", "",
             "| block | bits a weight | data MB | max \\|Δlogit\\| | greedy agreement | "
             "perplexity change | " + " | ".join(f"batch {B} tok/s (× block {first})"
                                                  for B in res["speed"]) + " |",
             "|---:|---:|---:|---:|---:|---:|" + "---:|" * len(res["speed"])]
    for f in res["artifacts"]:
        b = str(f["block_size"])
        cells = [f"{res['speed'][B][b]['tok_s']:,.0f} ({res['speed'][B][b]['vs_first']:.2f}×)"
                 for B in res["speed"]]
        ppl = f["perplexity_change"]
        lines.append(f"| {b} | {f['bits_per_weight']:g} | {f['data_mb']:.1f} | "
                     f"{f['max_abs_logit']:.2f} | {f['token_agreement']:.2f} | "
                     + ("–" if ppl is None else f"{ppl:+.2%}") + " | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def load(path: Path) -> dict:
    """The results file: one entry a size (``{"sizes": {size: results}}``)."""
    if not path.is_file():
        return {"sizes": {}}
    data = json.loads(path.read_text())
    return data if "sizes" in data else {"sizes": {data["size"]: data}}


def render_all(data: dict) -> str:
    return "\n".join(render(res) for res in data["sizes"].values()) + (
        "\nllama.cpp's q4_0 stores 4.5 bits a weight (blocks of 32 with a float16 scale); the "
        "bench measures it against kvserve's blocks of 64, the same size (bench/build.py: "
        "BENCH_INT4_BLOCK).\n")


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="bench-100m")
    ap.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=str(CACHE))
    ap.add_argument("--out", default=None, help="results .json path (default: under --cache)")
    ap.add_argument("--update-committed", action="store_true",
                    help="write bench/results/int4-blocks.json and .md")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite the .md of the results (--out or the committed ones) only")
    args = ap.parse_args(argv)
    if args.out and args.update_committed:
        ap.error("--out and --update-committed exclude each other")
    out = Path(RESULTS / "int4-blocks.json" if args.update_committed else
               args.out or Path(args.cache) / "int4-blocks.json")
    if args.render_only:
        out.with_suffix(".md").write_text(render_all(load(out)))
        return 0
    arts = build(args.size, Path(args.cache), args.blocks)
    res = {"size": args.size, "cpu": cpu_model(), "threads": args.threads,
           "onnxruntime": ort.__version__, "python": platform.python_version(),
           "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "rounds": args.rounds, "artifacts": [fidelity(a) for a in arts.values()],
           "speed": speed(arts, args.batches, args.rounds, args.threads)}
    data = load(out)
    data["sizes"][args.size] = res
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(render_all(data))
    print(render(res))
    print(f"written {out} and {out.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

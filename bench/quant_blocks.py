"""What a quantized export's block size buys and costs (a script): speed against fidelity.

    python bench/quant_blocks.py [--precision int4 | int8] [--size bench-100m | trained]
                                 [--blocks 32 64 128] [--rounds 7]
                                 [--update-committed | --out FILE.json] [--render-only]

The size's checkpoint (``bench/build.py``: random-init Llama, built when missing) is exported
once per block size (``kvserve export --precision int4 --int4-block-size N``, or int8 with
``--int8-block-size N``; cached under ``<cache>/models/<size>/<precision>-bN``); for int8,
block 0 is kvserve's default int8 (per-row activations in standard ops, ``int8-rows``). For
each artifact:

- what it stores: bits a weight (4 or 8 + 32 / N: one float32 scale per block; per-row int8:
  8, with 7 used, and one scale a column) and its data file;
- fidelity, from its manifest (the export's own gate against the fp32 torch model): max
  |Δlogit| over prefill and 64 decode steps, greedy token agreement, relative perplexity change
  on the held-out text (on random-init weights these are rough: every artifact is judged on the
  same prompts and text, so they compare the block sizes, not the model);
- batch movement: the largest |Δlogit| of a sequence's logits alone against the same sequence
  beside others (every row of batches of 2, 3, 8 and 16; the prefill's last position and 8
  decode steps): 0 where the kernels compute each row alone;
- speed: the raw decode loop (``bench/runner_kvserve.LoopRunner``: prefill 32 random tokens,
  then 64 greedy steps) at batch 1 and 8, every artifact loaded in one process and timed in
  alternating rounds; the ratio to the first block size is the median of the per-round ratios.

Results: ``<precision>-blocks.json`` (one entry a size; a run replaces its size's) and
``<precision>-blocks.md`` (``--update-committed``: ``bench/results/``; docs/export.md quotes
them).
``--size trained``: the default trained model (``bench/trained.py``, trained once into the
cache), whose perplexity is taken on held-out files: the fidelity figures that mean most.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from kvserve.bench.common import CACHE, committed_results, run_header

NEW_TOKENS = 64
HELD_OUT = 8  # held-out files of the trained model's perplexity text


ROWS = 0  # int8's "block" of kvserve's default: per-row activations, per-column weights


def build(size: str, cache: Path, blocks: list[int], precision: str = "int4"
          ) -> dict[int, Path]:
    """The size's artifacts of ``precision``, one per block size. ``trained``: the default
    trained model (``bench/trained.py``), its perplexity taken on held-out files (neither its
    weights nor its tokenizer saw them); the random-init sizes: on the export's default text."""
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
    if precision == "int4":
        return {b: build_artifacts(built.ckpt, built.root / f"int4-b{b}", "int4", int4_block=b,
                                   eval_text=eval_text) for b in blocks}
    return {b: build_artifacts(built.ckpt, built.root / (f"int8-b{b}" if b else "int8-rows"),
                               "int8", eval_text=eval_text, int8_block=b or None)
            for b in blocks}


def fidelity(art: Path) -> dict:
    m = json.loads((art / "manifest.json").read_text())
    q, ppl = m["parity"][m["precision"]], m.get("perplexity", {})
    quant = m.get("quantization") or {"block_size": ROWS, "bits_per_weight": 8}  # int8 rows
    return {"block_size": quant["block_size"], "bits_per_weight": quant["bits_per_weight"],
            "data_mb": (art / "model.onnx.data").stat().st_size / 2**20,
            "max_abs_logit": max(q["max_abs_logit_prefill"], q["max_abs_logit_decode"]),
            "token_agreement": q["token_agreement"],
            "perplexity_change": ppl.get("relative_change")}


MOVEMENT_BATCHES = (2, 3, 8, 16)


def batch_movement(art: Path, threads: int, steps: int = 8) -> float:
    """The largest |Δlogit| between a sequence alone and the same sequence in a batch of random
    others (``MOVEMENT_BATCHES``), every row of every batch, at the prefill's last position and
    over ``steps`` decode steps."""
    from kvserve.artifact.loader import load_lm

    lm = load_lm(art, provider="cpu", threads=threads, attention=False)
    V, rng, worst = lm.cfg.vocab_size, np.random.default_rng(1), 0.0
    for B in MOVEMENT_BATCHES:
        prompts = [rng.integers(2, V, int(n)).tolist() for n in rng.integers(3, 40, B)]
        tokens = rng.integers(2, V, (steps, B))
        batch = lm.new_cache(B)
        together = [np.stack([rows[-1] for rows in  # (B, V): each row's last position
                              lm.prefill(batch, 0, prompts, last=True).logits])]
        together += [lm.decode(batch, B, t.tolist())[0].copy() for t in tokens]
        for i in range(B):
            alone = lm.new_cache(1)
            mine = [lm.prefill(alone, 0, prompts[i:i + 1], last=True).logits[0][-1].copy()]
            mine += [lm.decode(alone, 1, [int(t)])[0][0].copy() for t in tokens[:, i]]
            worst = max(worst, max(float(np.abs(a - b[i]).max())
                                   for a, b in zip(mine, together)))
    return worst


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


def _label(block) -> str:
    return "rows (default)" if int(block) == ROWS else str(block)


def render(res: dict) -> str:
    precision = res.get("precision", "int4")
    first = _label(res["artifacts"][0]["block_size"])
    first = f"block {first}" if first.isdigit() else first
    lines = [f"## {precision} block size: speed and fidelity ({res['size']})", "",
             f"{res['cpu']}, {res['threads']} onnxruntime threads, onnxruntime "
             f"{res['onnxruntime']}; {res['date']}. Raw decode loop, {NEW_TOKENS} greedy tokens "
             f"after 32 random ones, medians of {res['rounds']} alternating rounds; fidelity "
             f"from each export's gate against the fp32 torch model"
             + (f" (the default trained model: perplexity on {HELD_OUT} held-out files, "
                f"neither trained on nor in its tokenizer's corpus, their first 4,096 tokens)"
                if res["size"] == "trained" else
                " (random-init weights: compare the rows, not the model)")
             + ". Data MB: the weights file (the embedding table stays float32). Batch "
             "movement: the largest |Δlogit| of a sequence alone against the same sequence in "
             f"batches of {', '.join(map(str, MOVEMENT_BATCHES))} (prefill and 8 decode steps; "
             "– : not measured in that run).", "",
             "| block | bits a weight | data MB | max \\|Δlogit\\| | greedy agreement | "
             "perplexity change | batch movement | "
             + " | ".join(f"batch {B} tok/s (× {first})" for B in res["speed"]) + " |",
             "|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(res["speed"])]
    for f in res["artifacts"]:
        b = str(f["block_size"])
        cells = [f"{res['speed'][B][b]['tok_s']:,.0f} ({res['speed'][B][b]['vs_first']:.2f}×)"
                 for B in res["speed"]]
        ppl, moved = f["perplexity_change"], f.get("batch_movement")
        lines.append(f"| {_label(b)} | {f['bits_per_weight']:g} | {f['data_mb']:.1f} | "
                     f"{f['max_abs_logit']:.2f} | {f['token_agreement']:.2f} | "
                     + ("–" if ppl is None else f"{ppl:+.2%}") + " | "
                     + ("–" if moved is None else f"{moved:.2g}") + " | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def load(path: Path) -> dict:
    """The results file: one entry a size (``{"sizes": {size: results}}``)."""
    if not path.is_file():
        return {"sizes": {}}
    data = json.loads(path.read_text())
    return data if "sizes" in data else {"sizes": {data["size"]: data}}


NOTES = {
    "int4": "\nllama.cpp's q4_0 stores 4.5 bits a weight (blocks of 32 with a float16 scale); the "
            "bench measures it against kvserve's blocks of 64, the same size (bench/build.py: "
            "BENCH_INT4_BLOCK).\n",
    "int8": "\nrows: kvserve's default int8 (`MatMulInteger` in standard ops; weights in 7 bits "
            "with one float32 scale a column, each row's activations quantized by the graph): a "
            "row's logits are bitwise the same in any batch. Blocks: 8-bit `MatMulNBits` (int8 "
            "activations inside the kernel), whose logits move a little with the batch. "
            "llama.cpp's q8_0 stores 8.5 bits a weight (blocks of 32 with a float16 scale); the "
            "bench measures it against kvserve's blocks of 64, the same size (bench/build.py: "
            "BENCH_INT8_BLOCK).\n"}


def render_all(data: dict) -> str:
    precision = next(iter(data["sizes"].values()), {}).get("precision", "int4")
    return "\n".join(render(res) for res in data["sizes"].values()) + NOTES[precision]


def main(argv: list[str] | None = None) -> int:

    from kvserve.export.logs import quiet_exporter_logs

    quiet_exporter_logs()  # (the quantizer's INFO line a tensor)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", choices=("int4", "int8"), default="int4")
    ap.add_argument("--size", default="bench-100m")
    ap.add_argument("--blocks", type=int, nargs="+", default=None,
                    help="block sizes (int4 default: 32 64 128; int8: 0 32 64 128, 0 being "
                         "kvserve's default per-row int8)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=str(CACHE))
    ap.add_argument("--out", default=None, help="results .json path (default: under --cache)")
    ap.add_argument("--update-committed", action="store_true",
                    help="write bench/results/<precision>-blocks.json and .md")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite the .md of the results (--out or the committed ones) only")
    args = ap.parse_args(argv)
    if args.out and args.update_committed:
        ap.error("--out and --update-committed exclude each other")
    name = f"{args.precision}-blocks.json"
    out = Path(committed_results("--update-committed") / name if args.update_committed
               else args.out or Path(args.cache) / name)
    if args.render_only:
        out.with_suffix(".md").write_text(render_all(load(out)))
        return 0
    blocks = args.blocks or ([32, 64, 128] if args.precision == "int4" else [ROWS, 32, 64, 128])
    if args.precision == "int4" and ROWS in blocks:
        ap.error("block 0 (per-row) is int8's only")
    arts = build(args.size, Path(args.cache), blocks, args.precision)
    res = {**run_header(size=args.size, precision=args.precision, threads=args.threads,
                        rounds=args.rounds),
           "artifacts": [{**fidelity(a), "batch_movement": batch_movement(a, args.threads)}
                         for a in arts.values()],
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

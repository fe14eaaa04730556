"""Paired attention (``kvserve export --paired-attention``): what it costs a step and what it
buys a server (a script).

    python bench/paired_attention.py [--rounds 7] [--new-tokens 128]
                                     [--update-committed | --out FILE.json] [--render-only]

On the 100M bench model's int8 (per row, the export's default) and int4 (blocks of 32, the
default) artifacts, each exported paired (``--paired-attention``) and unpaired (the default):
- **rows**: ``server.rounding.rows_differ``, the largest difference between the same tokens'
  logits from one-token steps, verifications and a prompt split in two (0: bit for bit alike);
- **step**: one decode step's time after 64 and 512 tokens, batch 1 and 8, the two graphs in
  alternating turns; paired / unpaired is the median of the rounds' ratios;
- **server**: kvserve's engine with the server's defaults on each (unpaired: the prefix cache
  and speculation are off there, the calls' rounding differs; paired: on, exact), and the
  paired artifact with speculation off; random 32-token prompts (new each round, the same for
  every runner), ``--new-tokens``, greedy, batch 1 and 8, alternating turns. 'same tokens'
  compares each runner's output with the paired artifact's with speculation off.

Results: ``paired-attention.json`` and ``.md`` (``--update-committed``: ``bench/results/``;
docs/speed.md quotes them).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from kvserve.bench.common import (parse_results_args, run_header, server_speedups,
                                  write_results)
from kvserve.bench.runner_base import alternate, prompts_for

PROMPT = 32
BATCHES = (1, 8)
CONTEXTS = (64, 512)
ARTIFACTS = {"int8": {}, "int4": {"int4_block": 32}}
OFF, PAIRED, UNPAIRED = "paired, speculation off", "paired, server defaults", \
    "unpaired, server defaults"


def _artifacts(cache: Path, threads: int) -> dict:
    from kvserve.bench.build import build_artifacts, build_ckpt, build_hf, sizes

    root = cache / "models" / "bench-100m"
    ckpt = build_ckpt(build_hf(sizes()["bench-100m"], cache, root / "hf"), root / "ckpt")
    return {(q, paired): build_artifacts(ckpt, root / f"{q}-{tag}", q, threads,
                                         paired=paired, **blocks)
            for q, blocks in ARTIFACTS.items()
            for paired, tag in ((True, "paired"), (False, "unpaired"))}


def _step_seconds(lm, B: int, ctx: int, steps: int = 24) -> float:
    kv = lm.new_cache(B, ctx + steps + 8)
    lm.prefill(kv, 0, prompts_for(B, ctx, lm.cfg.vocab_size, seed=ctx).tolist(), last=True)
    tokens = [5] * B
    lm.decode(kv, B, tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        lm.decode(kv, B, tokens)
    return (time.perf_counter() - t0) / steps


def steps(paired: Path, unpaired: Path, threads: int, rounds: int,
          contexts: tuple = CONTEXTS) -> dict:
    """Paired / unpaired decode step time per (batch, context)."""
    from kvserve.artifact.loader import load_lm
    from kvserve.server.rounding import rows_differ

    lms = {k: load_lm(p, provider="cpu", threads=threads, attention=False)
           for k, p in (("paired", paired), ("unpaired", unpaired))}
    out = {"rows_differ": {k: rows_differ(lm) for k, lm in lms.items()}, "steps": {}}
    for B in BATCHES:
        for ctx in contexts:
            t = {k: [] for k in lms}
            for rnd in range(rounds):
                for k in (list(lms) if rnd % 2 == 0 else list(lms)[::-1]):
                    t[k].append(_step_seconds(lms[k], B, ctx))
            out["steps"][f"{B}/{ctx}"] = {
                "paired_ms": 1e3 * float(np.median(t["paired"])),
                "unpaired_ms": 1e3 * float(np.median(t["unpaired"])),
                "ratio": float(np.median(np.divide(t["paired"], t["unpaired"])))}
    return out


def server(paired: Path, unpaired: Path, threads: int, rounds: int, new: int) -> dict:
    from kvserve.bench.runner_kvserve import EngineRunner

    on = server_speedups()
    mb = max(BATCHES)
    runners = {OFF: EngineRunner(str(paired), threads, max_batch=mb),
               PAIRED: EngineRunner(str(paired), threads, max_batch=mb, **on),
               UNPAIRED: EngineRunner(str(unpaired), threads, max_batch=mb, **on)}
    try:
        V, out = runners[OFF].cfg.vocab_size, {}
        for B in BATCHES:
            for r in runners.values():  # (warm-up, prompts of their own)
                r.generate(prompts_for(B, PROMPT, V, seed=10_000 + B), new)
            start = {k: (r.metrics.drafted, r.metrics.accepted) for k, r in runners.items()}
            tok_s, tokens = alternate(
                runners, lambda rnd: prompts_for(B, PROMPT, V, seed=100 * B + rnd), rounds, new)
            cell = {}
            for k in runners:
                d = runners[k].metrics.drafted - start[k][0]
                a = runners[k].metrics.accepted - start[k][1]
                cell[k] = {"tok_s_median": float(np.median(tok_s[k])),
                           "rounds_tok_s": [round(x, 1) for x in tok_s[k]],
                           "acceptance": a / d if d else None,
                           "same_tokens": float((tokens[k] == tokens[OFF]).mean())}
            ratios = {f"{a} / {b}": float(np.median(np.divide(tok_s[a], tok_s[b])))
                      for a, b in ((PAIRED, UNPAIRED), (PAIRED, OFF))}
            out[str(B)] = {"runners": cell, "ratios": ratios}
        return out
    finally:
        for r in runners.values():
            r.close()


def render(data: dict) -> str:
    out = ["# Paired attention: a step's price, a server's gain", "",
           f"`bench/paired_attention.py` on the 100M bench model ({data['cpu']}, "
           f"{data['threads']} threads, onnxruntime {data['onnxruntime']}, {data['date']}): "
           f"each artifact exported paired (`--paired-attention`) and unpaired. Rows: the largest "
           f"difference between the same tokens' logits from one-token steps, verifications "
           f"and a prompt split in two, over the largest logit (0: bit for bit). Steps: one "
           f"decode step, medians of {data['rounds']} alternating rounds.", "",
           "| artifact | rows differ, unpaired | paired | batch / context | unpaired step | "
           "paired step | paired / unpaired |", "|---|---|---|---|---|---|---|"]
    for q, cell in data["cells"].items():
        rd = cell["rows_differ"]
        for i, (k, s) in enumerate(cell["steps"].items()):
            rows = f"{rd['unpaired']:.1e} | {rd['paired']:.1e}" if i == 0 else " | "
            out.append(f"| {q if i == 0 else ''} | {rows} | {k} | {s['unpaired_ms']:.2f} ms | "
                       f"{s['paired_ms']:.2f} ms | {s['ratio']:.2f}× |")
    out += ["", f"The engine, random {PROMPT}-token prompts (new each round), "
                f"{data['new_tokens']} new tokens, greedy, tok/s medians of {data['rounds']} "
                f"alternating rounds; same tokens: share of the output equal to the paired "
                f"artifact's with speculation off.", "",
            "| artifact | batch | runner | tok/s | acceptance | same tokens |",
            "|---|---|---|---|---|---|"]
    ratios = []
    for q, cell in data["cells"].items():
        for B, c in cell["server"].items():
            for name, r in c["runners"].items():
                acc = "–" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
                same = f"{np.floor(1000 * r['same_tokens']) / 10:g}%"
                out.append(f"| {q} | {B} | {name} | {r['tok_s_median']:,.0f} | {acc} | "
                           f"{same} |")
            ratios += [f"| {q} | {B} | {k} | {v:.2f}× |" for k, v in c["ratios"].items()]
    out += ["", "Paired ratios (median over rounds):", "", "| artifact | batch | ratio | |",
            "|---|---|---|---|", *ratios]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    parsed = parse_results_args(ap, argv, "paired-attention.json", render)
    if parsed is None:
        return 0
    args, out = parsed
    data = run_header(rounds=args.rounds, new_tokens=args.new_tokens, threads=args.threads,
                      cells={})
    arts = _artifacts(Path(args.cache), args.threads)
    for q, blocks in ARTIFACTS.items():
        label = q + "".join(f", blocks of {b}" for b in blocks.values())
        cell = steps(arts[q, True], arts[q, False], args.threads, args.rounds)
        cell["server"] = server(arts[q, True], arts[q, False], args.threads, args.rounds,
                                args.new_tokens)
        data["cells"][label] = cell
        print(f"{label}: done", flush=True)
    write_results(out, data, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""kvserve's speculation against llama.cpp with llama-cpp-python's prompt-lookup decoding (a
script): the bench's llama.cpp cells compare plain decoding, where at batch 1 both read every
weight once a token; here each side also runs its n-gram drafting, as its users would switch
it on.

    python bench/lookup_peers.py [--sizes bench-6m bench-100m] [--rounds 7] [--new-tokens 128]
                                 [--update-committed | --out FILE.json] [--render-only]

Per size and precision (6M: fp32; 100M: fp32, int8, int4 against f32, q8_0, q4_0 GGUFs of the
same weights, ``bench/gguf_convert.py``), batch 1 and 8, greedy, random 32-token prompts
(``prompts_for``, new ones each round, the same for every runner in it: nothing comes from
kvserve's prefix cache) and ``--new-tokens`` new tokens, tok/s = batch × new tokens / wall
time:
- llama.cpp: llama-cpp-python's low-level API (``bench/runner_llamacpp.py``), plain (one KV
  cache for the batch, as its server's parallel slots), and with prompt lookup
  (llama-cpp-python's ``LlamaPromptLookupDecoding``, its defaults: up to 10 draft tokens after
  the first earlier match of the last 2 tokens, else of the last one; a KV cache per
  sequence);
- kvserve's engine in-process: speculation off, the server's defaults (prefix cache and
  speculation on; on unpaired int8 / int4 artifacts both stay off by default, exact:
  server.rounding), and on int8 / int4 ``--inexact-speedups`` (speculation on there too);
  on int8 / int4 also an export with ``--paired-attention`` (``PAIRED_BLOCKS``: int8 in the
  same 8-bit blocks of 64, int4 in blocks of 32), speculation off and the server's defaults
  (on there, exact).
The runners take turns in alternating order in one process; a ratio is the median over rounds
of the two runners' turns in the same round. 'same tokens' compares each output with its own
runtime's plain decoding (llama.cpp with llama.cpp, kvserve with kvserve; the two runtimes'
int4 weights are quantized differently, their tokens are not compared).

Results: ``lookup-peers.json`` and ``.md`` (``--update-committed``: ``bench/results/``;
docs/speed.md quotes them). Needs ``pip install 'kvserve[llamacpp]'``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from kvserve.bench.common import (parse_results_args, run_header, server_speedups,
                                  write_results)
from kvserve.bench.runner_base import alternate, prompts_for

PROMPT = 32
BATCHES = (1, 8)
LOOKUP = 10  # llama-cpp-python's LlamaPromptLookupDecoding default num_pred_tokens
PRECISIONS = {"bench-6m": [("fp32", "f32")],
              "bench-100m": [("fp32", "f32"), ("int8", "q8_0"), ("int4", "q4_0")]}
LLAMA, LOOKUP_RUN = "llama.cpp", "llama.cpp + prompt lookup"
OFF, ON, INEXACT = "kvserve, speculation off", "kvserve, server defaults", \
    "kvserve, --inexact-speedups"
PAIRED_OFF, PAIRED_ON = "kvserve paired, speculation off", "kvserve paired, server defaults"
# whose tokens a runner's should be
PLAIN = {LOOKUP_RUN: LLAMA, ON: OFF, INEXACT: OFF, PAIRED_ON: PAIRED_OFF}
# the paired exports (``kvserve export --paired-attention``) beside the bench's int8 / int4:
# the same 8-bit blocks of 64; int4 in blocks of 32 (the bench's 64, q4_0's size, computes a
# single row with another kernel, which pairing cannot make alike)
PAIRED_BLOCKS = {"int8": {"int8_block": 64}, "int4": {"int4_block": 32}}


def _runners(artifact: Path, gguf: Path, precision: str, threads: int,
             paired: Path | None = None) -> dict:
    from kvserve.bench.runner_kvserve import EngineRunner
    from kvserve.bench.runner_llamacpp import LlamaCppRunner

    on = server_speedups()
    mb = max(BATCHES)
    out = {LLAMA: LlamaCppRunner(str(gguf), threads),
           LOOKUP_RUN: LlamaCppRunner(str(gguf), threads, lookup=LOOKUP),
           OFF: EngineRunner(str(artifact), threads, max_batch=mb),
           ON: EngineRunner(str(artifact), threads, max_batch=mb, **on)}
    if precision != "fp32":
        out[INEXACT] = EngineRunner(str(artifact), threads, max_batch=mb, inexact_speedups=True,
                                    **on)
    if paired is not None:
        out[PAIRED_OFF] = EngineRunner(str(paired), threads, max_batch=mb)
        out[PAIRED_ON] = EngineRunner(str(paired), threads, max_batch=mb, **on)
    return out


def _counts(r) -> tuple[int, int]:
    """(drafted, accepted) so far: llama.cpp's lookup totals or the engine's metrics."""
    m = getattr(r, "metrics", None)
    return (m.drafted, m.accepted) if m is not None else (r.drafted, r.accepted)


def measure(artifact: Path, gguf: Path, precision: str, rounds: int, new: int,
            threads: int, paired: Path | None = None) -> dict:
    runners = _runners(artifact, gguf, precision, threads, paired)
    try:
        V = runners[OFF].cfg.vocab_size
        names = list(runners)
        out = {}
        for B in BATCHES:
            for r in runners.values():  # (warm-up, prompts of their own)
                r.generate(prompts_for(B, PROMPT, V, seed=10_000 + B), new)
            start = {k: _counts(r) for k, r in runners.items()}
            cached0 = runners[ON].metrics.cached_tokens
            tok_s, tokens = alternate(
                runners, lambda rnd: prompts_for(B, PROMPT, V, seed=100 * B + rnd), rounds, new)
            cell = {}
            for k in names:
                d0, a0 = start[k]
                d1, a1 = _counts(runners[k])
                plain = PLAIN.get(k)
                cell[k] = {"tok_s_median": float(np.median(tok_s[k])),
                           "tok_s_best": float(max(tok_s[k])),
                           "rounds_tok_s": [round(x, 1) for x in tok_s[k]],
                           "acceptance": (a1 - a0) / (d1 - d0) if d1 > d0 else None,
                           "same_tokens": None if plain is None else
                           float((tokens[k] == tokens[plain]).mean())}
            pairs = [(ON, LLAMA), (ON, LOOKUP_RUN)] + \
                [(INEXACT, LOOKUP_RUN)] * (INEXACT in tok_s) + \
                [(PAIRED_ON, LLAMA), (PAIRED_ON, LOOKUP_RUN)] * (PAIRED_ON in tok_s)
            ratios = {f"{a} / {b}": float(np.median(np.divide(tok_s[a], tok_s[b])))
                      for a, b in pairs}
            out[str(B)] = {"runners": cell, "ratios": ratios,
                           "cached_tokens": runners[ON].metrics.cached_tokens - cached0}
        return out
    finally:
        for r in runners.values():
            r.close()


def render(data: dict) -> str:
    out = ["# Speculation against llama.cpp with prompt lookup", "",
           f"`bench/lookup_peers.py`: random {PROMPT}-token prompts, {data['new_tokens']} new "
           f"tokens, greedy; tok/s medians of {data['rounds']} alternating rounds (best in "
           f"brackets), new prompts each round; {data['cpu']}, {data['threads']} threads, "
           f"onnxruntime {data['onnxruntime']}, llama-cpp-python {data['llama_cpp']}, "
           f"{data['date']}. "
           f"Acceptance: accepted / drafted tokens. Same tokens: share of the output equal to "
           f"its own runtime's plain decoding.", "",
           "| size, precision | batch | runner | tok/s | acceptance | same tokens |",
           "|---|---|---|---|---|---|"]
    ratios = []
    for key, batches in data["cells"].items():
        for B, cell in batches.items():
            for name, r in cell["runners"].items():
                acc = "–" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
                same = "–" if r["same_tokens"] is None else \
                    f"{np.floor(1000 * r['same_tokens']) / 10:g}%"  # (99.96%: not 100%)
                out.append(f"| {key} | {B} | {name} | {r['tok_s_median']:,.0f} "
                           f"({r['tok_s_best']:,.0f}) | {acc} | {same} |")
            ratios += [f"| {key} | {B} | {k} | {v:.2f}× |" for k, v in cell["ratios"].items()]
    out += ["", "Paired ratios (median over rounds):", "",
            "| size, precision | batch | ratio | |", "|---|---|---|---|", *ratios]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    import llama_cpp

    from kvserve.bench.build import build, build_artifacts
    from kvserve.bench.gguf_convert import gguf_files

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    parsed = parse_results_args(ap, argv, "lookup-peers.json", render)
    if parsed is None:
        return 0
    args, out = parsed
    data = run_header(rounds=args.rounds, new_tokens=args.new_tokens, threads=args.threads,
                      lookup_tokens=LOOKUP, llama_cpp=llama_cpp.__version__, cells={})
    cache = Path(args.cache)
    for size in args.sizes:
        quantized = size == "bench-100m"
        built = build(size, cache, genai=False, int8=quantized, int4=quantized,
                      threads=args.threads)
        ggufs = gguf_files(built.hf, built.root / "gguf", cache,
                           [q for _, q in PRECISIONS[size]])
        for precision, quant in PRECISIONS[size]:
            art = getattr(built, precision)
            paired = None if precision not in PAIRED_BLOCKS else build_artifacts(
                built.ckpt, built.root / f"{precision}-lookup-paired", precision, args.threads,
                paired=True, **PAIRED_BLOCKS[precision])
            data["cells"][f"{size} {precision} / {quant}"] = measure(
                art, ggufs[quant], precision, args.rounds, args.new_tokens, args.threads,
                paired)
            print(f"{size} {precision}: done", flush=True)
    write_results(out, data, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())

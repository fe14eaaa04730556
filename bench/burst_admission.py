"""Requests that arrive together (a script). On a cached prefix: their times to first token
with the rests of their prompts prefilled in groups of one call each, as the engine admits them,
against one request at a time, as it did before (the runner's ``prefills_after_rows`` switched
off). New prompts of different lengths: grouped as now (a prompt joins a group only where the
padding it adds costs less than a call: ``Scheduler.pad_tokens``) against all in one call
padded to the longest, as before.

    python bench/burst_admission.py [--sizes bench-6m bench-100m] [--requests 8] [--rounds 9]
                                    [--update-committed | --out FILE.json] [--render-only]

Each round, per way: a new 1,000-token system prompt (random tokens) is cached by one request
of its own, then ``--requests`` requests of that prompt and 16-47 more random tokens each are
submitted together (``Engine.submit_many``, greedy, 4 new tokens); the figures are the last
request's time to first token and the mean over the requests, from the submission. New
prompts: ``--requests`` prompts of 16-47 random tokens, the prefix cache off. The two ways
alternate in one process, in alternating order; the ratio is the median of the rounds'.
The in-process engine with the server's defaults (prefix cache and speculation on), fp32,
``bench/build.py``'s models.

Results: ``burst-admission.json`` and ``.md`` (``--update-committed``: ``bench/results/``;
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

SYSTEM_TOKENS = 1000
NEW_TOKENS = 4
WAYS = ("one call", "one at a time")
NEW_WAYS = ("grouped", "one padded call")


def _burst(runner, system: list[int], rests: list[list[int]]) -> tuple[float, float]:
    """(last, mean) time to first token in ms of the requests submitted together."""
    from kvserve.server.domain import TokenEvent

    reqs = [runner._request(system + r, NEW_TOKENS) for r in rests]
    t0 = time.perf_counter()
    firsts = []
    for h in runner.engine.submit_many(reqs):
        for ev in h:
            if isinstance(ev, TokenEvent) and ev.index == 0:
                firsts.append(time.perf_counter() - t0)
    return 1000 * max(firsts), 1000 * float(np.mean(firsts))


def _summary(figures: dict, ways: tuple[str, str]) -> dict:
    med = {w: {"last_ttft_ms": float(np.median([a for a, _ in v])),
               "mean_ttft_ms": float(np.median([b for _, b in v])),
               "rounds_last_ttft_ms": [round(a, 2) for a, _ in v]} for w, v in figures.items()}
    ratio = float(np.median([a / b for (a, _), (b, _) in zip(figures[ways[0]],
                                                              figures[ways[1]])]))
    return {"ways": med, "last_ttft_ratio": ratio}


def measure_new(artifact: Path, requests: int, rounds: int, threads: int) -> dict:
    """New prompts of different lengths, grouped against one padded call."""
    from kvserve.bench.runner_kvserve import EngineRunner

    runner = EngineRunner(str(artifact), threads, max_batch=requests, prefix_cache_mb=0,
                          speculative_tokens=8)
    V, sched = runner.cfg.vocab_size, runner.engine.sched
    pad = sched.pad_tokens
    g = np.random.default_rng(1)
    figures = {w: [] for w in NEW_WAYS}
    try:
        for r in range(rounds):
            for way in (NEW_WAYS if r % 2 == 0 else NEW_WAYS[::-1]):
                sched.pad_tokens = pad if way == "grouped" else None
                prompts = [g.integers(2, V, int(n)).tolist() for n in g.integers(16, 48, requests)]
                figures[way].append(_burst(runner, [], prompts))
                time.sleep(0.05)
    finally:
        runner.engine.stop()
    return _summary(figures, NEW_WAYS)


def measure(artifact: Path, requests: int, rounds: int, threads: int,
            system_tokens: int = SYSTEM_TOKENS) -> dict:
    from kvserve.bench.runner_kvserve import EngineRunner

    runner = EngineRunner(str(artifact), threads, max_batch=requests, **server_speedups())
    lm, V = runner.lm, runner.cfg.vocab_size
    g = np.random.default_rng(0)
    figures = {w: [] for w in WAYS}
    for r in range(rounds):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            lm.prefills_after_rows = way == "one call"
            system = g.integers(2, V, system_tokens).tolist()
            for _ in runner.engine.submit(runner._request(system + [5], 1)):
                pass
            time.sleep(0.05)  # (the engine idles: the system prompt's rows are in the pool)
            rests = [g.integers(2, V, int(n)).tolist() for n in g.integers(16, 48, requests)]
            figures[way].append(_burst(runner, system, rests))
    runner.engine.stop()
    return _summary(figures, WAYS)


def render(data: dict) -> str:
    out = ["# Requests arriving together", "",
           f"`bench/burst_admission.py`: {data['requests']} requests submitted together; times "
           f"to first token from the submission, the last request's and the mean (medians of "
           f"{data['rounds']} alternating rounds; {data['cpu']}, {data['threads']} threads, "
           f"onnxruntime {data['onnxruntime']}, {data['date']}; fp32).", "",
           f"On a cached {SYSTEM_TOKENS}-token prefix, 16-47 tokens each after it:", "",
           "| size | rests in groups of one call | one at a time (before) | last, ratio |",
           "|---|---|---|---|"]
    out += _rows(data, "cached", WAYS)
    out += ["", "New prompts of 16-47 tokens (prefix cache off):", "",
            "| size | grouped by padding | one call padded to the longest (before) | "
            "last, ratio |", "|---|---|---|---|"]
    out += _rows(data, "new", NEW_WAYS)
    return "\n".join(out) + "\n"


def _rows(data: dict, cell: str, ways: tuple[str, str]) -> list[str]:
    out = []
    for size, cells in data["sizes"].items():
        res = cells[cell]
        a, b = (res["ways"][w] for w in ways)
        out.append(f"| {size} | {a['last_ttft_ms']:.1f} / {a['mean_ttft_ms']:.1f} ms | "
                   f"{b['last_ttft_ms']:.1f} / {b['mean_ttft_ms']:.1f} ms | "
                   f"{res['last_ttft_ratio']:.2f}× |")
    return out


def main(argv: list[str] | None = None) -> int:

    from kvserve.bench.build import build

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["bench-6m", "bench-100m"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    parsed = parse_results_args(ap, argv, "burst-admission.json", render)
    if parsed is None:
        return 0
    args, out = parsed
    data = run_header(requests=args.requests, rounds=args.rounds, threads=args.threads,
                      sizes={})
    for size in args.sizes:
        art = build(size, Path(args.cache), genai=False, int8=False).fp32
        data["sizes"][size] = {
            "cached": measure(art, args.requests, args.rounds, args.threads),
            "new": measure_new(art, args.requests, args.rounds, args.threads)}
    write_results(out, data, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())

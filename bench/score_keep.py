"""Keeping Score's rows for later Scores, and backing off: one-off Score requests (nothing
repeats: the device copy of their rows into the prefix cache is pure cost) and few-shot
requests (a header every request repeats: the copy pays), a request a sequence, on the
in-process engine with the server's defaults (fp32, ``bench/build.py``'s models).

    python bench/score_keep.py [--sizes bench-6m bench-100m] [--rounds 5]
                               [--update-committed | --out FILE.json] [--render-only]

Ways (``Engine.score_keep``): **always** keeps every Score's rows (the behaviour before
``server.score_cache.KeepPolicy``), **adaptive** is the server's default (backs off after
``KEEP_AFTER_MISSES`` sequences in a row found nothing kept, then keeps one in
``PROBE_EVERY``), **never** keeps none. Each cell: ``REQUESTS`` requests a round after
``WARM`` untimed ones (the adaptive way's steady state), new random tokens each round, the
ways in alternating order. Figures: milliseconds a request (median over rounds), the prompt
tokens taken from the cache a request, and the ratio to always. Results:
``score-keep.json`` and ``.md`` (``--update-committed``: ``bench/results/``; docs/speed.md
quotes them).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from kvserve.bench.common import fp32_sizes_main, server_speedups
from kvserve.bench.score_shared import timed_score

REQUESTS, WARM, HEADER = 96, 40, 150
WAYS = ("always", "adaptive", "never")


def _one_off(g, V: int, n: int, tokens: int) -> list[list[int]]:
    return [g.integers(2, V, tokens).tolist() for _ in range(n)]


def _few_shot(g, V: int, n: int, _tokens: int = 0) -> list[list[int]]:
    header = g.integers(2, V, HEADER).tolist()
    return [header + g.integers(2, V, int(g.integers(30, 51))).tolist() for _ in range(n)]


CELLS = {"one-off, 32 tokens": (_one_off, 32), "one-off, 128 tokens": (_one_off, 128),
         "few-shot (150-token header + 30-50)": (_few_shot, 0)}


def _policy(way: str):
    from kvserve.server.score_cache import KeepPolicy

    return {"always": KeepPolicy(after=1 << 62), "adaptive": KeepPolicy(),
            "never": KeepPolicy(after=0, every=1 << 62)}[way]


def _requests(engine, seqs) -> tuple[float, int]:
    """(milliseconds a request, prompt tokens taken from the cache) of a request a
    sequence."""
    hits0 = engine.metrics.cached_tokens
    ms, _ = timed_score(engine, seqs, one_each=True)
    return ms / len(seqs), engine.metrics.cached_tokens - hits0


def measure(artifact: Path, rounds: int, threads: int) -> dict:
    from kvserve.bench.runner_kvserve import EngineRunner

    runner = EngineRunner(str(artifact), threads, **server_speedups())
    engine, V = runner.engine, runner.cfg.vocab_size
    assert engine.score_shares, "the engine keeps no Score rows with this artifact"
    out: dict = {}
    try:
        for name, (make, tokens) in CELLS.items():
            ms: dict[str, list] = {w: [] for w in WAYS}
            hit: dict[str, list] = {w: [] for w in WAYS}
            for r in range(rounds):
                for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                    g = np.random.default_rng([r, len(name), WAYS.index(way)])
                    engine.score_keep = _policy(way)
                    _requests(engine, make(g, V, WARM, tokens))
                    t, h = _requests(engine, make(g, V, REQUESTS, tokens))
                    ms[way].append(t)
                    hit[way].append(h / REQUESTS)
            out[name] = {w: {"ms": float(np.median(ms[w])),
                             "rounds_ms": [round(x, 3) for x in ms[w]],
                             "cached_tokens": float(np.median(hit[w])),
                             "ratio_to_always": float(np.median(
                                 np.divide(ms[w], ms["always"])))} for w in WAYS}
    finally:
        engine.score_keep = _policy("adaptive")
        runner.close()
    return out


def render(data: dict) -> str:
    out = ["# Keeping Score's rows, and backing off", "",
           f"`bench/score_keep.py`: a Score request a sequence on the in-process engine with "
           f"the server's defaults, {REQUESTS} requests a round after {WARM} untimed ones, "
           f"medians of {data['rounds']} alternating rounds ({data['cpu']}, "
           f"{data['threads']} threads, onnxruntime {data['onnxruntime']}, {data['date']}; "
           f"fp32). Always: every Score's rows copied into the prefix cache (before the back-off); "
           f"adaptive: the server's default (`server.score_cache.KeepPolicy`); never: none. "
           f"Cached: prompt tokens a request took from the cache.", "",
           "| size | cell | way | ms a request | cached tokens a request | to always |",
           "|---|---|---|---|---|---|"]
    for size, cells in data["sizes"].items():
        for name in CELLS:
            for w in WAYS:
                c = cells[name][w]
                out.append(f"| {size} | {name} | {w} | {c['ms']:.2f} | "
                           f"{c['cached_tokens']:.0f} | {c['ratio_to_always']:.3f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    return fp32_sizes_main(__doc__, argv, "score-keep.json", render, measure)


if __name__ == "__main__":
    sys.exit(main())

"""Score requests whose sequences begin alike (a context scored with several continuations,
as lm-evaluation-harness's multiple-choice tasks send them, in a batch or a request each):
their shared tokens computed once (``server/scoring.py``; across requests through the prefix
cache, ``server/score_cache.py``; the server's default) against every sequence computed
whole, on the in-process engine with the server's defaults (fp32, ``bench/build.py``'s
models).

    python bench/score_shared.py [--sizes bench-6m bench-100m] [--rounds 7]
                                 [--update-committed | --out FILE.json] [--render-only]

One Score request a cell (the last: a request a sequence), new random tokens each round;
the two ways take turns in alternating order (``Engine.score_shares``: off, nothing is
shared, nor taken from or kept in the prefix cache). Cells (tokens: context + continuation):

- **choices**: ``QUESTIONS`` contexts of ``CONTEXT`` tokens, each with ``CHOICES``
  continuations of 1-6 tokens;
- **few-shot**: a ``HEADER``-token header shared by every question, then ``QUESTIONS``
  questions of 30-50 tokens with ``CHOICES`` continuations of 1-6 tokens each;
- **long context**: 2 contexts of ``LONG`` tokens (past the 100M model's Score chunk: each
  sequence is scored in chunks when not shared), ``CHOICES`` continuations each;
- **few-shot, a request each**: the few-shot cell's sequences in a request each, one after
  the other (lm-evaluation-harness's batch size 1): each takes the rows and
  log-probabilities the earlier ones kept in the prefix cache.

Figures: the request's wall time (median over rounds), the ratio (median of the rounds'
unshared / shared: above 1, sharing is faster), and the largest logprob difference between
the ways. Results: ``score-shared.json`` and ``.md`` (``--update-committed``:
``bench/results/``; docs/speed.md quotes them).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from kvserve.bench.common import fp32_sizes_main, server_speedups

QUESTIONS, CHOICES, CONTEXT, HEADER, LONG = 8, 4, 200, 150, 600
WAYS = ("shared", "whole")


def _choices(g, V: int) -> list[list[int]]:
    out = []
    for _ in range(QUESTIONS):
        ctx = g.integers(2, V, CONTEXT).tolist()
        out += [ctx + g.integers(2, V, int(g.integers(1, 7))).tolist() for _ in range(CHOICES)]
    return out


def _few_shot(g, V: int) -> list[list[int]]:
    header = g.integers(2, V, HEADER).tolist()
    out = []
    for _ in range(QUESTIONS):
        q = header + g.integers(2, V, int(g.integers(30, 51))).tolist()
        out += [q + g.integers(2, V, int(g.integers(1, 7))).tolist() for _ in range(CHOICES)]
    return out


def _long(g, V: int) -> list[list[int]]:
    out = []
    for _ in range(2):
        ctx = g.integers(2, V, LONG).tolist()
        out += [ctx + g.integers(2, V, int(g.integers(1, 7))).tolist() for _ in range(CHOICES)]
    return out


def _one_each(g, V: int) -> list[list[int]]:
    return _few_shot(g, V)


CELLS = {"choices": _choices, "few-shot": _few_shot, "long context": _long,
         "few-shot, a request each": _one_each}


def timed_score(engine, seqs, one_each: bool = False) -> tuple[float, list]:
    """(milliseconds, results) of one Score request of ``seqs`` (``one_each``: a request a
    sequence, one after the other, as lm-evaluation-harness's batch size 1 sends them)."""
    from kvserve.server.domain import ScoreRequest

    t0 = time.perf_counter()
    res = []
    for part in ([[s] for s in seqs] if one_each else [seqs]):
        _, fut = engine.submit_score(ScoreRequest(sequences=part))
        res += fut.result()
    return 1000 * (time.perf_counter() - t0), res


def measure(artifact: Path, rounds: int, threads: int) -> dict:
    from kvserve.bench.runner_kvserve import EngineRunner

    runner = EngineRunner(str(artifact), threads, **server_speedups())
    engine, V = runner.engine, runner.cfg.vocab_size
    assert engine.score_shares, "the engine shares no rows with this artifact"
    out = {"chunk_tokens": engine.chunk_tokens}
    try:
        timed_score(engine, _choices(np.random.default_rng(99), V))  # warm-up
        for name, make in CELLS.items():
            ms: dict[str, list] = {w: [] for w in WAYS}
            diff = 0.0
            for r in range(rounds):
                seqs = make(np.random.default_rng([r, 11]), V)
                got = {}
                for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                    engine.score_shares = way == WAYS[0]
                    t, got[way] = timed_score(engine, seqs, make is _one_each)
                    ms[way].append(t)
                diff = max(diff, max(float(np.abs(a.logprobs - b.logprobs).max())
                                     for a, b in zip(*got.values())))
            engine.score_shares = True
            out[name] = {"sequences": len(seqs), "tokens": sum(map(len, seqs)),
                         "ways": {w: {"ms": float(np.median(v)),
                                      "rounds_ms": [round(x, 2) for x in v]}
                                  for w, v in ms.items()},
                         "ratio": float(np.median([b / a for a, b in
                                                   zip(ms[WAYS[0]], ms[WAYS[1]])])),
                         "max_logprob_diff": diff}
    finally:
        engine.stop()
    return out


def render(data: dict) -> str:
    out = ["# Score: sequences that begin alike", "",
           f"`bench/score_shared.py`: one Score request a cell (the last: one a sequence) on the "
           f"in-process engine with the "
           f"server's defaults, the shared first tokens of its sequences computed once against "
           f"every sequence whole (medians of {data['rounds']} alternating rounds; "
           f"{data['cpu']}, {data['threads']} threads, onnxruntime {data['onnxruntime']}, "
           f"{data['date']}; fp32), new random tokens each round.", "",
           f"Choices: {QUESTIONS} contexts of {CONTEXT} tokens with {CHOICES} continuations of "
           f"1-6 tokens each. Few-shot: a {HEADER}-token header, then {QUESTIONS} questions of "
           f"30-50 tokens with {CHOICES} continuations of 1-6 tokens. Long context: 2 contexts "
           f"of {LONG} tokens with {CHOICES} continuations each (past the 100M model's Score "
           f"chunk, so each sequence whole is scored in chunks). Few-shot, a request each: "
           f"the few-shot sequences in a request each, one after the other (the time of all; "
           f"shared: each takes what the earlier ones kept in the prefix cache).", "",
           "| size | cell | sequences (tokens) | shared | whole | ratio | largest logprob "
           "difference |", "|---|---|---|---|---|---|---|"]
    for size, cells in data["sizes"].items():
        for name in CELLS:
            c = cells[name]
            a, b = (c["ways"][w]["ms"] for w in WAYS)
            out.append(f"| {size} | {name} | {c['sequences']} ({c['tokens']:,}) | "
                       f"{a:,.1f} ms | {b:,.1f} ms | {c['ratio']:.2f}× | "
                       f"{c['max_logprob_diff']:.1e} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    return fp32_sizes_main(__doc__, argv, "score-shared.json", render, measure)


if __name__ == "__main__":
    sys.exit(main())

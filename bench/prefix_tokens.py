"""The prefix cache reusing a prefix to the token (whole blocks, then the first rows of one
more: where a prompt parts from a cached one inside a block, or a request's unfinished last
block) against whole blocks only (as before 2026-12-04, and as vLLM's automatic prefix
caching), on the in-process engine with the server's defaults (fp32, ``bench/build.py``'s
models).

    python bench/prefix_tokens.py [--sizes bench-6m bench-100m] [--rounds 7]
                                  [--update-committed | --out FILE.json] [--render-only]

Two cells, each round both ways in one process, in alternating order, each on new random
tokens (the same ones would be cached by the other way's turn):

- **interleaved chats**: ``CHATS`` conversations take turns (one request at a time, each
  sending its whole history: a first prompt of ``FIRST`` tokens, then its replies of
  ``REPLY`` greedy tokens and user turns of 24-40 tokens), ``TURNS`` turns each. A
  conversation's slot has served the others since its last turn, so its history comes from
  the pool. Figure: the sum of the times to first token of every turn after the first.
- **a burst on a cached prefix**: a new ``SYSTEM``-token prompt cached by a request of its
  own, then ``BURST`` requests of it and 16-47 more tokens each submitted together (the
  prefix is not a whole number of blocks: whole blocks leave its last 8 tokens to every
  request). Figure: the last request's time to first token.

The ratio is the median of the rounds' (whole blocks / to the token: above 1, faster to the
token). Results: ``prefix-tokens.json`` and ``.md`` (``--update-committed``:
``bench/results/``; docs/speed.md quotes them).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from kvserve.bench.common import fp32_sizes_main, server_speedups

CHATS, TURNS, FIRST, REPLY = 4, 6, 200, 32
SYSTEM, BURST = 1000, 8
WAYS = ("to the token", "whole blocks")


def _ttft(runner, prompt: list[int], n: int) -> tuple[float, list[int], int]:
    """(time to first token in ms, the greedy tokens, prompt tokens cached) of one request."""
    tokens, first, _ = runner.timed(np.asarray(prompt, np.int64)[None], n)
    return 1000 * first, tokens[0].tolist(), runner.counters["cached_tokens"]


def chats(runner, g) -> tuple[float, int]:
    """(sum of the later turns' times to first token in ms, their cached tokens)."""
    V = runner.cfg.vocab_size
    history = [g.integers(2, V, FIRST).tolist() for _ in range(CHATS)]
    total, cached = 0.0, 0
    for turn in range(TURNS):
        for c in range(CHATS):
            prompt = history[c] + ([] if turn == 0 else
                                   g.integers(2, V, int(g.integers(24, 41))).tolist())
            ms, reply, hit = _ttft(runner, prompt, REPLY)
            if turn:
                total, cached = total + ms, cached + hit
            history[c] = prompt + reply
    return total, cached


def burst(runner, g) -> tuple[float, int]:
    """(the last request's time to first token in ms, the requests' cached tokens)."""
    from kvserve.server.domain import FinishEvent, TokenEvent

    V = runner.cfg.vocab_size
    system = g.integers(2, V, SYSTEM).tolist()
    _ttft(runner, system + [5], 1)
    time.sleep(0.05)  # (the engine idles: the prompt's rows are in the pool)
    reqs = [runner._request(system + g.integers(2, V, int(n)).tolist(), 4)
            for n in g.integers(16, 48, BURST)]
    t0 = time.perf_counter()
    last, cached = 0.0, 0
    for h in runner.engine.submit_many(reqs):
        for ev in h:
            if isinstance(ev, TokenEvent) and ev.index == 0:
                last = max(last, time.perf_counter() - t0)
            elif isinstance(ev, FinishEvent):
                cached += ev.cached_tokens
    return 1000 * last, cached


def measure(artifact: Path, rounds: int, threads: int) -> dict:
    from kvserve.bench.runner_kvserve import EngineRunner

    runner = EngineRunner(str(artifact), threads, max_batch=BURST, **server_speedups())
    prefix = runner.engine.prefix
    out = {}
    try:
        for name, cell in (("chats", chats), ("burst", burst)):
            figures: dict[str, list] = {w: [] for w in WAYS}
            for r in range(rounds):
                for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                    prefix.to_the_token = way == WAYS[0]
                    # (new tokens for each way: the other's would be cached by then)
                    figures[way].append(cell(runner, np.random.default_rng(
                        [r, WAYS.index(way), 7])))
            out[name] = {
                "ways": {w: {"ms": float(np.median([a for a, _ in v])),
                             "cached_tokens": int(np.median([b for _, b in v])),
                             "rounds_ms": [round(a, 2) for a, _ in v]}
                         for w, v in figures.items()},
                "ratio": float(np.median([b / a for (a, _), (b, _) in
                                          zip(figures[WAYS[0]], figures[WAYS[1]])]))}
    finally:
        runner.engine.stop()
    return out


def render(data: dict) -> str:
    out = ["# The prefix cache to the token", "",
           f"`bench/prefix_tokens.py`: the in-process engine with the server's defaults, the "
           f"prefix cache reusing a prefix to the token against whole blocks only (medians of "
           f"{data['rounds']} alternating rounds; {data['cpu']}, {data['threads']} threads, "
           f"onnxruntime {data['onnxruntime']}, {data['date']}; fp32), new random tokens each "
           f"round and way.", "",
           f"Interleaved chats: {CHATS} conversations taking turns, each sending its whole "
           f"history ({FIRST}-token first prompts, {REPLY}-token replies, user turns of 24-40 "
           f"tokens), {TURNS} turns each; the sum of the times to first token of the turns "
           f"after the first, and their cached prompt tokens. A burst: {BURST} requests "
           f"together on a cached {SYSTEM}-token prefix with 16-47 tokens each; the last "
           f"one's time to first token, and the requests' cached tokens.", "",
           "| size | cell | to the token | whole blocks | ratio |", "|---|---|---|---|---|"]
    for size, cells in data["sizes"].items():
        for name, label in (("chats", "interleaved chats"), ("burst", "burst")):
            a, b = (cells[name]["ways"][w] for w in WAYS)
            out.append(f"| {size} | {label} | {a['ms']:,.1f} ms ({a['cached_tokens']:,} "
                       f"cached) | {b['ms']:,.1f} ms ({b['cached_tokens']:,} cached) | "
                       f"{cells[name]['ratio']:.2f}× |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    return fp32_sizes_main(__doc__, argv, "prefix-tokens.json", render, measure)


if __name__ == "__main__":
    sys.exit(main())

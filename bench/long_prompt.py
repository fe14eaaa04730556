"""A long prompt arriving while others stream (a script): how long the streams stop, fed a chunk
per engine iteration against the whole prompt at once (as before).

    python bench/long_prompt.py [--sizes bench-100m] [--rounds 7] [--threads 2]
                                [--update-committed | --out FILE.json] [--render-only]

Each round, per way: ``STREAMS`` greedy streams (32-token random prompts) are decoding when a
request with a new random prompt of ``PROMPT_TOKENS`` tokens arrives; the figures are the
streams' longest gap between two tokens while that prompt is prefilled (on the engine's clock:
``RecordingMetrics``, free of the consumer's wake-up), how many tokens they made meanwhile, and
the long prompt's time to first token. The two ways alternate in one process, in alternating
order (the scheduler's ``interleave`` switched); ratios are medians of the rounds'. The
in-process engine with the server's defaults (prefix cache and speculation on), fp32,
``bench/build.py``'s models; the prefill chunk is the server's default
(``--prefill-chunk-tokens 0``: 488-512 tokens on 100M; on 6M the logits cap's 1,953 tokens,
a call then takes the whole prompt: there is nothing to interleave) and, in an engine of its
own measured in the same rounds, each of ``ASKED`` (``--prefill-chunk-tokens N``).

Results: ``long-prompt.json`` and ``.md`` (``--update-committed``: ``bench/results/``;
docs/speed.md quotes them).
"""
from __future__ import annotations

import sys
import threading
import time

import numpy as np

from kvserve.bench.common import fp32_sizes_main, server_speedups

PROMPT_TOKENS = 1500
STREAMS = 2
WAYS = ("a chunk an iteration", "at once")
ASKED = (128,)  # smaller chunks asked for: shorter pauses, more calls


def _round(runner, long_prompt: list[int], streams: list[list[int]]) -> dict:
    """The streams started, the long prompt submitted once they decode: its time to first
    token, the streams' longest gap and tokens in that time."""
    from kvserve.server.domain import TokenEvent

    engine, metrics = runner.engine, runner.metrics
    handles = engine.submit_many([runner._request(p, 4000) for p in streams])
    counts = [0] * len(handles)

    def drain(i):
        for ev in handles[i]:
            if isinstance(ev, TokenEvent):
                counts[i] += 1
    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(handles))]
    for t in threads:
        t.start()
    while min(counts) < 8 and all(t.is_alive() for t in threads):  # (all decoding)
        time.sleep(0.001)
    before = list(counts)
    metrics.gaps.clear()
    t0 = time.perf_counter()
    (h,) = engine.submit_many([runner._request(long_prompt, 1)])
    ttft = None
    for ev in h:
        if isinstance(ev, TokenEvent) and ttft is None:
            ttft = time.perf_counter() - t0
    made = sum(c - b for c, b in zip(counts, before))
    after = list(counts)
    while min(c - a for c, a in zip(counts, after)) < 2 and \
            all(t.is_alive() for t in threads):  # (the step after the prompt's prefill
        time.sleep(0.001)  # records the streams' gap across it)
    gaps = list(metrics.gaps)
    alive = all(t.is_alive() for t in threads)
    for x in handles:
        x.cancel()
    for t in threads:
        t.join()
    if not alive or not gaps:
        raise RuntimeError("a stream ended before the long prompt's first token: the "
                           "measurement needs them decoding throughout")
    return {"ttft_ms": 1e3 * ttft, "longest_gap_ms": 1e3 * max(gaps, default=0.0),
            "stream_tokens": made}


def measure(artifact, rounds: int, threads: int) -> dict:
    """Per setting (``default``, then each of ``ASKED``): both ways' medians and ratios;
    settings and ways alternate round by round."""
    from kvserve.bench.runner_kvserve import EngineRunner

    settings = {"default": 0, **{str(n): n for n in ASKED}}
    runners = {name: EngineRunner(str(artifact), threads, max_batch=STREAMS + 1,
                                  prefill_chunk_tokens=n, **server_speedups())
               for name, n in settings.items()}
    g = np.random.default_rng(0)
    figures = {name: {w: [] for w in WAYS} for name in settings}
    chunks = {}
    try:
        for r in range(rounds):
            for name in (list(settings) if r % 2 == 0 else list(settings)[::-1]):
                runner = runners[name]
                V = runner.cfg.vocab_size
                for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                    runner.engine.sched.interleave = way == WAYS[0]
                    streams = [g.integers(2, V, 32).tolist() for _ in range(STREAMS)]
                    figures[name][way].append(_round(
                        runner, g.integers(2, V, PROMPT_TOKENS).tolist(), streams))
                    time.sleep(0.1)
        chunks = {name: runner.engine.sched.prefill_tokens() for name, runner in runners.items()}
    finally:
        for runner in runners.values():
            runner.engine.stop()
    return {"settings": {name: _summary(figures[name], chunks[name]) for name in settings}}


def _summary(figures: dict, chunk: int) -> dict:
    out = {"chunk_tokens": chunk, "ways": {}}
    for w, rs in figures.items():
        out["ways"][w] = {k: float(np.median([x[k] for x in rs])) for k in rs[0]}
        out["ways"][w]["rounds"] = rs
    a, b = (figures[w] for w in WAYS)
    out["gap_ratio"] = float(np.median([x["longest_gap_ms"] / y["longest_gap_ms"]
                                        for x, y in zip(a, b)]))
    out["ttft_ratio"] = float(np.median([x["ttft_ms"] / y["ttft_ms"] for x, y in zip(a, b)]))
    return out


def render(data: dict) -> str:
    out = ["# A long prompt arriving while others stream", "",
           f"`bench/long_prompt.py`: {STREAMS} greedy streams decoding when a "
           f"{PROMPT_TOKENS:,}-token prompt arrives; the streams' longest gap between two "
           f"tokens while it is prefilled (the engine's clock), the tokens they made meanwhile, "
           f"its time to first token (medians of {data['rounds']} alternating rounds; "
           f"{data['cpu']}, {data['threads']} threads, onnxruntime {data['onnxruntime']}, "
           f"{data['date']}; fp32, the server's defaults, and `--prefill-chunk-tokens N` in an "
           f"engine of its own).", "",
           "| size | `--prefill-chunk-tokens` | chunk | way | streams' longest gap | their tokens "
           "meanwhile | long prompt's TTFT |", "|---|---|---|---|---|---|---|"]
    for size, by in data["sizes"].items():
        for name, res in by["settings"].items():
            asked = "0 (default)" if name == "default" else name
            for w in WAYS:
                c = res["ways"][w]
                out.append(f"| {size} | {asked} | {res['chunk_tokens']} | {w} | "
                           f"{c['longest_gap_ms']:,.1f} ms | {c['stream_tokens']:.0f} | "
                           f"{c['ttft_ms']:,.1f} ms |")
            out.append(f"| {size} | {asked} | | ratio | {res['gap_ratio']:.2f}× | | "
                       f"{res['ttft_ratio']:.2f}× |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    return fp32_sizes_main(__doc__, argv, "long-prompt.json", render, measure)


if __name__ == "__main__":
    sys.exit(main())

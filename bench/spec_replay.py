"""Replay of the speculation policy on a model's own greedy continuations, charged with step
costs measured on this machine: what the policy makes of them, without the noise of timing
every step of a live engine (this 2-core machine's speed drifts by up to 2x within minutes,
more than the policy changes one wants to compare).

1. continuations: the artifact continues the held-out files' prompts greedily (the bench's
   runner loop, ``LoopRunner``: prefill, then ``decode`` and argmax), ``--new`` tokens each;
2. costs, two tables: onnxruntime's seconds for one call of S = 1 .. K + 1 positions at
   batch 1 (the model's own ``decode`` / ``verify``, each shape repeated in a row, the median
   of several passes) over S = 1's; and what the engine itself measured (``StepCosts``: whole
   steps, the call and the handling of its tokens, among the engine's other threads) after
   serving the same prompts with speculation on;
3. replay: the engine's ``Speculator`` (``server/speculation.py``: the n-gram lookups, the
   acceptance estimates, ``StepCosts``, the backoff) drafts for each sequence as in the
   engine; greedy verification keeps exactly the draft's prefix that agrees with the
   continuation, plus one token; each step is charged its shape's measured cost.

The figure is the tokens per unit of cost over the plain steps' (1 token per step at cost 1):
the speedup speculation gives where steps cost what the table says.

    python -m kvserve.bench.spec_replay --cache .bench [--update]

``--update`` writes ``bench/results/spec-replay.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "spec-replay.json"


def continuations(loop, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt continued ``n`` tokens greedily, batch 1 (``loop``: the bench's
    ``LoopRunner``, the runner's own prefill / decode / argmax loop)."""
    import numpy as np

    return [loop.generate(np.asarray([p], np.int64), n)[0].tolist() for p in prompts]


def call_costs(lm, prompt: list[int], max_positions: int, repeats: int = 20,
               passes: int = 5) -> dict[int, float]:
    """{S: seconds of a call of S positions at batch 1 / a plain step's}: each shape timed
    ``repeats`` times in a row after ``prompt``, the median per pass, the median of the
    passes' ratios."""
    import numpy as np

    kv = lm.new_cache(1, capacity=len(prompt) + max_positions + 1)
    lm.prefill(kv, 0, [np.asarray(prompt, np.int64)], last=True)
    base = int(kv.used[0])
    ratios: dict[int, list[float]] = {S: [] for S in range(1, max_positions + 1)}
    for _ in range(passes):
        med = {}
        for S in range(1, max_positions + 1):
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                if S == 1:
                    lm.decode(kv, 1, [5])
                else:
                    lm.verify(kv, 1, [[5] * S])
                ts.append(time.perf_counter() - t0)
                kv.truncate(0, base)
            med[S] = statistics.median(ts)
        for S in med:
            ratios[S].append(med[S] / med[1])
    return {S: statistics.median(v) for S, v in ratios.items()}


def engine_costs(artifact: str, prompts: list[list[int]], n: int, threads: int,
                 k_max: int) -> dict[int, float]:
    """{S: a step of S positions at batch 1 / a plain step}, as the engine measured them
    (``StepCosts.relative``: measured shapes, the others interpolated) after continuing
    ``prompts`` ``n`` tokens each with speculation on."""
    from .runner_kvserve import EngineRunner

    r = EngineRunner(artifact, threads=threads, max_batch=1, speculative_tokens=k_max)
    try:
        for p in prompts:
            r.timed([p], n)
        return {S: r.engine.costs.relative(1, S) for S in range(1, k_max + 2)}
    finally:
        r.engine.stop()


def replay(prompts: list[list[int]], outs: list[list[int]], costs: dict[int, float],
           k_max: int = 8) -> dict:
    """The engine's speculator on these continuations, each step charged ``costs[S]``."""
    from kvserve.model.sampling import SamplingParams
    from kvserve.server.domain import GenerateRequest, OutputParams, StopParams
    from kvserve.server.sequence import Handle, Sequence
    from kvserve.server.speculation import Speculator

    sp = Speculator(k_max, max_seq_len=1 << 20)
    unit = 1e-3  # (a plain step: 1 ms)
    tokens = steps = verified = 0
    cost = 0.0
    for prompt, out in zip(prompts, outs):
        req = GenerateRequest(list(prompt), SamplingParams(),
                              StopParams(max_new_tokens=len(out)), OutputParams())
        seq = Sequence(req, Handle("replay", lambda: None), submitted=0.0)
        sp.admit(seq)
        seq.generated = [out[0]]  # (the prefill's token)
        while len(seq.generated) < len(out):
            i = len(seq.generated)
            drafts = sp.drafts([seq])
            if drafts is None:
                sp.backoff.plain_step(1, sp.costs.plain_step(1, unit))
                seq.generated.append(out[i])
                tokens, steps, cost = tokens + 1, steps + 1, cost + 1.0
                continue
            draft = drafts[0]
            m = 0
            while m < len(draft) and i + m < len(out) - 1 and draft[m] == out[i + m]:
                m += 1
            S = 1 + len(draft)
            seconds = costs[S] * unit
            sp.record(seq, len(draft), m)
            sp.costs.verify_step(1, S, seconds)
            sp.backoff.verify_step(1, seconds, m + 1)
            seq.generated.extend(out[i:i + m + 1])
            tokens, steps, verified, cost = tokens + m + 1, steps + 1, verified + 1, \
                cost + costs[S]
    return {"speedup": tokens / cost, "tokens_per_step": tokens / steps,
            "verification_steps": verified, "steps": steps, "tokens": tokens,
            "drafted": sp.drafted, "accepted": sp.accepted,
            "acceptance": sp.accepted / sp.drafted if sp.drafted else None}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=".bench", help="where `kvserve bench --sizes trained` "
                    "keeps the default trained model (models/trained/fp32)")
    ap.add_argument("--artifact", help="another artifact instead")
    ap.add_argument("--new", type=int, default=128, help="tokens continued per file")
    ap.add_argument("--k", type=int, default=8, help="--speculative-tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--update", action="store_true", help=f"write {RESULTS}")
    args = ap.parse_args(argv)
    from .runner_kvserve import LoopRunner
    from .trained import code_prompts, held_out_files

    art = Path(args.artifact or Path(args.cache) / "models" / "trained" / "fp32")
    if not (art / "manifest.json").is_file():
        raise SystemExit(f"no artifact at {art}: run `kvserve bench --sizes trained "
                         f"--cache {args.cache}` first (it trains and exports the model)")
    prompts, names = code_prompts(art / "tokenizer.json", held_out_files())
    loop = LoopRunner(str(art), threads=args.threads)
    t0 = time.perf_counter()
    outs = continuations(loop, prompts, args.new)
    tables = {"onnxruntime": call_costs(loop.lm, prompts[0], args.k + 1),
              "engine": engine_costs(str(art), prompts, args.new, args.threads, args.k)}
    out = {"artifact": str(art), "files": names, "new_tokens": args.new, "k": args.k,
           "threads": args.threads, "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for name, costs in tables.items():
        out[name] = {"relative_costs": {str(S): round(c, 3) for S, c in costs.items()},
                     **replay(prompts, outs, costs, args.k)}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1))
    if args.update:
        RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()

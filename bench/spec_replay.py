"""Replay of the speculation policy on a model's own greedy continuations, charged with step
costs measured on this machine: what the policy makes of them, without the noise of timing
every step of a live engine (this 2-core machine's speed drifts by up to 2x within minutes,
more than the policy changes one wants to compare).

1. continuations: the artifact continues the held-out files' prompts greedily (the bench's
   runner loop, ``LoopRunner``: prefill, then ``decode`` and argmax), ``--new`` tokens each;
2. costs, three tables: onnxruntime's seconds for one call of S = 1 .. K + 1 positions at
   batch 1 (the model's own ``decode`` / ``verify``, each shape repeated in a row, the median
   of several passes) over S = 1's; what the engine itself measured (``StepCosts``: whole
   steps, the call and the handling of its tokens, among the engine's other threads) after
   serving the same prompts with speculation on; and onnxruntime's at every n = 1 .. ``--batch``
   rows, over a plain call at ``--batch`` rows;
3. replay: the engine's ``Speculator`` (``server/speculation.py``: the n-gram lookups, the
   acceptance estimates, ``StepCosts``, the backoff) drafts for each sequence as in the
   engine, one at a time with the first two tables, ``--batch`` at a time (as the bench's
   spec cell: the group waits for its slowest row) with the third; greedy verification
   keeps exactly the draft's prefix that agrees with the continuation, plus one token; each
   step is charged its shape's measured cost.

The figure is the plain steps' cost over the replay's: the speedup speculation gives where
steps cost what the table says (at batch 1: the tokens per unit of cost).

4. the bound (batch 1, each table): what any policy could make of the same n-gram drafts at
   those costs, knowing each draft's fate in advance (``oracle``: per position, a plain step
   or the lookup's draft cut to its best length, the cheapest path to the end by dynamic
   programming). A speedup target above it is out of reach of n-gram drafts on that machine.
   Beside it, ``by_length``: the best one draft length per matched n-gram length can make,
   each chosen knowing how often that length's drafts agreed over the whole run (what a
   policy reading the match length, and nothing else, can at best make).

    python -m kvserve.bench.spec_replay --cache .bench [--update]

``--update`` writes ``bench/results/spec-replay.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .common import RESULTS as _COMMITTED, committed_results

RESULTS = _COMMITTED / "spec-replay.json"


def continuations(loop, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt continued ``n`` tokens greedily, batch 1 (``loop``: the bench's
    ``LoopRunner``, the runner's own prefill / decode / argmax loop)."""
    import numpy as np

    return [loop.generate(np.asarray([p], np.int64), n)[0].tolist() for p in prompts]


def call_costs(lm, prompt: list[int], max_positions: int, repeats: int = 20,
               passes: int = 5, batch: int = 1) -> dict[tuple[int, int], float]:
    """{(n, S): seconds of a call of S positions a row at batch n / a plain step's at
    ``batch``} for n = 1 .. ``batch``: each shape timed ``repeats`` times in a row after
    ``prompt`` (every row), the median per pass, the median of the passes' ratios."""
    import numpy as np

    kv = lm.new_cache(batch, capacity=len(prompt) + max_positions + 1)
    lm.prefill(kv, 0, [np.asarray(prompt, np.int64)] * batch, last=True)
    base = int(kv.used[0])
    shapes = [(n, S) for n in range(1, batch + 1) for S in range(1, max_positions + 1)]
    ratios: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    for _ in range(passes):
        med = {}
        for n, S in shapes:
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                if S == 1:
                    lm.decode(kv, n, [5] * n)
                else:
                    lm.verify(kv, n, [[5] * S] * n)
                ts.append(time.perf_counter() - t0)
                for b in range(n):
                    kv.truncate(b, base)
            med[n, S] = statistics.median(ts)
        for shape in shapes:
            ratios[shape].append(med[shape] / med[batch, 1])
    return {shape: statistics.median(v) for shape, v in ratios.items()}


def engine_costs(artifact: str, prompts: list[list[int]], n: int, threads: int,
                 k_max: int) -> dict[tuple[int, int], float]:
    """{(1, S): a step of S positions at batch 1 / a plain step}, as the engine measured them
    (``StepCosts.relative``: measured shapes, the others interpolated) after continuing
    ``prompts`` ``n`` tokens each with speculation on."""
    from .runner_kvserve import EngineRunner

    r = EngineRunner(artifact, threads=threads, max_batch=1, speculative_tokens=k_max)
    try:
        for p in prompts:
            r.timed([p], n)
        return {(1, S): r.engine.costs.relative(1, S) for S in range(1, k_max + 2)}
    finally:
        r.engine.stop()


def replay(prompts: list[list[int]], outs: list[list[int]],
           costs: dict[tuple[int, int], float], k_max: int = 8, batch: int = 1) -> dict:
    """The engine's speculator on these continuations (equal lengths), ``batch`` at a time as
    the bench's spec cell submits them (a group waits for its slowest row; nothing queued), a
    step of S positions at n rows charged ``costs[n, S]``. ``speedup``: the plain steps'
    cost over the replay's."""
    from kvserve.model.sampling import SamplingParams
    from kvserve.server.domain import GenerateRequest, OutputParams, StopParams
    from kvserve.server.sequence import Handle, Sequence
    from kvserve.server.speculation import Speculator

    sp = Speculator(k_max, max_seq_len=1 << 20)
    unit = 1e-3  # (a plain step at ``batch`` rows: 1 ms)
    tokens = steps = verified = 0
    cost = plain = 0.0
    for lo in range(0, len(prompts), batch):
        active, goal = [], {}
        for prompt, out in zip(prompts[lo:lo + batch], outs[lo:lo + batch]):
            req = GenerateRequest(list(prompt), SamplingParams(),
                                  StopParams(max_new_tokens=len(out)), OutputParams())
            seq = Sequence(req, Handle("replay", lambda: None), submitted=0.0)
            sp.admit(seq)
            seq.generated = [out[0]]  # (the prefill's token)
            active.append(seq)
            goal[id(seq)] = out
        plain += max(len(o) - 1 for o in goal.values()) * costs[len(active), 1]
        while active:
            n = len(active)
            drafts = sp.drafts(active)
            S = 1 if drafts is None else 1 + max(map(len, drafts))
            seconds = costs[n, S] * unit
            if drafts is None:
                sp.backoff.plain_step(n, sp.costs.plain_step(n, seconds))
                drafts = [[]] * n
            emitted = 0
            for seq, draft in zip(active, drafts):
                out, i = goal[id(seq)], len(seq.generated)
                m = _agreeing(draft, out, i)
                if S > 1:
                    sp.record(seq, len(draft), m)
                seq.generated.extend(out[i:i + m + 1])
                emitted += m + 1
            if S > 1:
                sp.costs.verify_step(n, S, seconds)
                sp.backoff.verify_step(n, seconds, emitted)
                verified += 1
            tokens, steps, cost = tokens + emitted, steps + 1, cost + costs[n, S]
            active = [s for s in active if len(s.generated) < len(goal[id(s)])]
    return {"speedup": plain / cost, "tokens_per_step": tokens / steps,
            "verification_steps": verified, "steps": steps, "tokens": tokens,
            "drafted": sp.drafted, "accepted": sp.accepted,
            "acceptance": sp.accepted / sp.drafted if sp.drafted else None}


def oracle(prompts: list[list[int]], outs: list[list[int]], costs: dict[tuple[int, int], float],
           k_max: int = 8) -> dict:
    """The bound at batch 1: each continuation's cheapest path where at every position the
    step is plain (cost 1) or verifies the n-gram lookup's draft there (``NgramIndex``, as
    the speculator's) cut to a length L up to the tokens it gets right (cost ``costs[1, L +
    1]``, L + 1 tokens), chosen knowing the outcome. ``speedup``: the plain steps' cost over
    that path's."""
    plain = cost = 0.0
    for prompt, out in zip(prompts, outs):
        N = len(out)  # out[0] came with the prefill; a state j has out[:j], 1 <= j <= N
        agree = [0] + [m for _, m in _agreements(prompt, out, k_max)]
        best = [0.0] * (N + 1)  # best[j]: the cheapest way from out[:j] to all N tokens
        for j in range(N - 1, 0, -1):
            best[j] = costs[1, 1] + best[j + 1]
            for L in range(1, agree[j] + 1):
                best[j] = min(best[j], costs[1, L + 1] + best[j + L + 1])
        plain += (N - 1) * costs[1, 1]
        cost += best[1]
    return {"speedup": plain / cost}


def _agreements(prompt: list[int], out: list[int], k_max: int) -> list[tuple[int, int]]:
    """Per state j = 1 .. N - 1 (``out[:j]`` generated): (the lookup's matched length, how
    many of its draft's tokens agree with the continuation)."""
    from kvserve.server.ngram import NgramIndex

    index, got = NgramIndex(prompt), []
    for j in range(1, len(out)):
        index.append(out[j - 1])
        draft = index.propose(k_max)  # (then ``matched`` is this draft's)
        got.append((index.matched, _agreeing(draft, out, j)))
    return got


def _agreeing(draft: list[int], out: list[int], i: int) -> int:
    """How many of ``draft``'s tokens agree with the continuation ``out`` from position
    ``i`` on, short of its last token (the step that follows a verification emits one)."""
    m = 0
    while m < len(draft) and i + m < len(out) - 1 and draft[m] == out[i + m]:
        m += 1
    return m


def by_length(prompts: list[list[int]], outs: list[list[int]],
              costs: dict[tuple[int, int], float], k_max: int = 8) -> dict:
    """Batch 1: one draft length L(n) per matched n-gram length n (0: a plain step), each
    the best for the whole run's agreements after n-token matches (``(1 + E[min(agree, L)])
    / cost(L + 1)`` against one token per plain step), then walked along each continuation.
    ``speedup``: the plain steps' cost over the walk's; ``lengths``: {n: L(n)}."""
    seen: dict[int, list[int]] = {}
    runs = [_agreements(p, o, k_max) for p, o in zip(prompts, outs)]
    for run in runs:
        for n, m in run:
            seen.setdefault(n, []).append(m)
    lengths = {}
    for n, ms in seen.items():
        best, lengths[n] = 1.0 / costs[1, 1], 0
        for L in range(1, k_max + 1):
            v = (1 + sum(min(m, L) for m in ms) / len(ms)) / costs[1, L + 1]
            if n and v > best:
                best, lengths[n] = v, L
    plain = cost = 0.0
    for out, run in zip(outs, runs):
        j, N = 1, len(out)
        while j < N:
            n, m = run[j - 1]
            L = lengths.get(n, 0)
            if L == 0:
                cost, j = cost + costs[1, 1], j + 1
            else:
                cost, j = cost + costs[1, L + 1], j + min(m, L) + 1
        plain += (N - 1) * costs[1, 1]
    return {"speedup": plain / cost, "lengths": dict(sorted(lengths.items()))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=".bench", help="where `kvserve bench --sizes trained` "
                    "keeps the default trained model (models/trained/fp32)")
    ap.add_argument("--artifact", help="another artifact instead")
    ap.add_argument("--new", type=int, default=128, help="tokens continued per file")
    ap.add_argument("--k", type=int, default=8, help="--speculative-tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="the batched replay's size (the "
                    "bench's spec cell: a group of this many waits for its slowest row)")
    ap.add_argument("--update", action="store_true", help=f"write {RESULTS}")
    args = ap.parse_args(argv)
    if args.update:  # (before the measurement it would write)
        committed_results("--update")
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
    # batch 1: onnxruntime's call costs and the engine's step costs; batched: onnxruntime's
    runs = {"onnxruntime": (1, call_costs(loop.lm, prompts[0], args.k + 1)),
            "engine": (1, engine_costs(str(art), prompts, args.new, args.threads, args.k))}
    if args.batch > 1:
        runs[f"onnxruntime_batch{args.batch}"] = (args.batch, call_costs(
            loop.lm, prompts[0], args.k + 1, batch=args.batch))
    out = {"artifact": str(art), "files": names, "new_tokens": args.new, "k": args.k,
           "threads": args.threads, "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for name, (batch, costs) in runs.items():
        out[name] = {"batch": batch,
                     "relative_costs": {(str(S) if batch == 1 else f"{n}x{S}"): round(c, 3)
                                        for (n, S), c in costs.items()},
                     **replay(prompts, outs, costs, args.k, batch)}
        if batch == 1:
            out[name]["bound"] = oracle(prompts, outs, costs, args.k)["speedup"]
            out[name]["by_length"] = by_length(prompts, outs, costs, args.k)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1))
    if args.update:
        RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()

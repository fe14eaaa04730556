"""Profile of the decode loop (``kvserve bench --profile``): where a decode step's time goes.

1. Raw loop split: the artifact's runner (``kvserve.artifact.load_lm``: FusedLM or PortableLM)
   decoding greedily, each step timed through public calls only: the ``decode`` call, the part
   of it inside onnxruntime's run (the runner's ``ort_seconds``), and the argmax. The decode
   call minus its onnxruntime time is the runner's Python/numpy overhead.
2. Engine: the real engine thread under cProfile for ``steps`` steps (through
   ``Engine.iteration_hook``), and the engine's own split (time inside the runner's ``decode``
   and inside onnxruntime vs the step period, from its metrics hooks and ``ort_seconds``).
3. tracemalloc over engine iterations (``Engine.iteration_hook``): transient peak bytes per
   iteration and live growth per iteration.
Writes ``profile.md`` and ``profile.json`` into the results directory (``bench/results`` unless
``--results`` says otherwise).
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import time
import tracemalloc
from pathlib import Path

from .common import committed_results
from .runner_base import prompts_for
from .runner_kvserve import EngineRunner, LoopRunner


# --- 1. raw loop split -------------------------------------------------------------------------
def loop_split(artifact: str, threads: int, batch: int, steps: int, prompt_len: int = 32
               ) -> dict:
    r = LoopRunner(artifact, threads)
    lm = r.lm
    prompts = prompts_for(batch, prompt_len, r.cfg.vocab_size)
    r.generate(prompts, 8)  # warm-up
    kv, tok = r.start(prompts, prompt_len + steps + 2)
    phases = {"decode call": [], "inside onnxruntime": [], "decode outside onnxruntime": [],
              "argmax": []}
    pc = time.perf_counter
    for _ in range(steps):
        ort0 = lm.ort_seconds
        t0 = pc()
        logits, _ = lm.decode(kv, batch, tok)
        t1 = pc()
        tok = logits.argmax(-1)
        t2 = pc()
        inside = lm.ort_seconds - ort0
        phases["decode call"].append(t1 - t0)
        phases["inside onnxruntime"].append(inside)
        phases["decode outside onnxruntime"].append(t1 - t0 - inside)
        phases["argmax"].append(t2 - t1)
    per_step = [a + b for a, b in zip(phases["decode call"], phases["argmax"])]
    total = sum(per_step)
    return {"batch": batch, "steps": steps, "runner": type(lm).__name__,
            "phases_us": {k: 1e6 * statistics.median(v) for k, v in phases.items()},
            "share": {k: sum(v) / total for k, v in phases.items()},
            "step_us": 1e6 * statistics.median(per_step), "step_us_mean": 1e6 * total / steps,
            "outside_ort_share": 1 - sum(phases["inside onnxruntime"]) / total}


# --- 2. engine under cProfile ------------------------------------------------------------------
def engine_profile(artifact: str, threads: int, batch: int, steps: int, top: int = 25) -> dict:
    r = EngineRunner(artifact, threads, max_batch=max(batch, 1))
    prompts = prompts_for(batch, 32, r.cfg.vocab_size)
    eng, lm = r.engine, r.lm
    try:
        r.generate(prompts, 8)  # warm-up
        r.metrics.steps.clear()
        prof = cProfile.Profile()

        def profiled(run):  # the engine thread's loop body, one iteration per call
            prof.enable()
            try:
                run()
            finally:
                prof.disable()

        eng.iteration_hook = profiled
        t0 = time.perf_counter()
        try:
            r.generate(prompts, steps)
        finally:
            eng.iteration_hook = None
        wall = time.perf_counter() - t0
        inside = sum(s for _, s in r.metrics.steps)
        st = pstats.Stats(prof, stream=io.StringIO()).sort_stats("tottime")
        rows = _stats_rows(st, top)
        # the same run without the profiler: the engine's own split
        r.metrics.steps.clear()
        ort0 = lm.ort_seconds
        t0 = time.perf_counter()
        r.generate(prompts, steps)
        wall2 = time.perf_counter() - t0
        ort = lm.ort_seconds - ort0  # prefill included: one call against `steps` decode calls
        inside2 = sum(s for _, s in r.metrics.steps)
        n_steps = len(r.metrics.steps)
    finally:
        r.close()
    return {"batch": batch, "steps": steps, "profiled_wall_s": wall,
            "profiled_decode_s": inside, "wall_s": wall2, "decode_s": inside2, "ort_s": ort,
            "engine_steps": n_steps, "overhead_us_per_step": 1e6 * (wall2 - inside2) / n_steps,
            "decode_us_per_step": 1e6 * inside2 / n_steps,
            "ort_us_per_step": 1e6 * ort / n_steps, "top": rows}


def _stats_rows(st: pstats.Stats, top: int) -> list[dict]:
    items = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    out = []
    for (file, line, fn), (cc, nc, tt, ct, _) in items:
        short = "/".join(Path(file).parts[-2:]) if file != "~" else "builtin"
        out.append({"function": f"{short}:{line}({fn})", "calls": nc, "tottime_s": tt,
                    "cumtime_s": ct})
    return out


# --- 3. allocations ----------------------------------------------------------------------------
def engine_allocations(artifact: str, threads: int, batch: int, steps: int) -> dict:
    r = EngineRunner(artifact, threads, max_batch=max(batch, 1))
    prompts = prompts_for(batch, 32, r.cfg.vocab_size)
    eng = r.engine
    peaks: list[tuple[int, int]] = []

    def traced(run):  # one engine iteration: admission, a decode step, retirement
        cur0, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        run()
        cur1, peak = tracemalloc.get_traced_memory()
        peaks.append((peak - cur0, cur1 - cur0))

    try:
        r.generate(prompts, 8)
        tracemalloc.start(1)
        try:
            snap0 = tracemalloc.take_snapshot()
            eng.iteration_hook = traced
            try:
                r.generate(prompts, steps)
            finally:
                eng.iteration_hook = None
            snap1 = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    finally:
        r.close()
    # the tracer's own allocations (this hook's list, tracemalloc's) are not the engine's
    mine = [tracemalloc.Filter(False, __file__), tracemalloc.Filter(False, tracemalloc.__file__)]
    growth = snap1.filter_traces(mine).compare_to(snap0.filter_traces(mine), "lineno")
    growth = [g for g in growth if g.size_diff > 0][:8]
    trans = [p for p, _ in peaks]
    live = [d for _, d in peaks]
    return {"batch": batch, "steps": len(peaks),
            "transient_peak_bytes_median": int(statistics.median(trans)),
            "live_growth_bytes_per_step_median": int(statistics.median(live)),
            "top_growth": [{"where": str(g.traceback[0]), "bytes": g.size_diff,
                            "blocks": g.count_diff} for g in growth]}


# --- report ------------------------------------------------------------------------------------
def write_report(data: dict, out: Path) -> None:
    L = ["# Decode-loop profile", "",
         f"Model {data['model']}, {data['threads']} intra-op threads, 1-minute load average "
         f"{data['load_before']:.2f} → {data['load_after']:.2f} (2 cores shared: absolute "
         f"times are noisy, the shares and counts are what to read). Generated by "
         f"`kvserve bench --profile`; the JSON is `profile.json`.", ""]
    runner = data["loop"][0]["runner"] if data["loop"] else "the runner"
    L += [f"## 1. Raw loop ({runner}.decode + argmax, timed per step)", "",
          "The decode call's time inside onnxruntime's run comes from the runner's "
          "`ort_seconds`; the rest of the call is the runner's Python/numpy overhead.", "",
          "Medians per step; the shares are of the summed step time.", "",
          "| batch | step µs | decode call | inside onnxruntime | decode outside onnxruntime "
          "| argmax | outside onnxruntime |", "|---|---|---|---|---|---|---|"]
    for s in data["loop"]:
        p, sh = s["phases_us"], s["share"]
        L.append(f"| {s['batch']} | {s['step_us']:.0f} | " + " | ".join(
            f"{p[k]:.1f} µs ({sh[k]:.0%})" for k in p) +
            f" | {s['outside_ort_share']:.0%} |")
    L += ["", "## 2. Engine thread (cProfile) and the engine's own split", ""]
    for e in data["engine"]:
        period = e["overhead_us_per_step"] + e["decode_us_per_step"]
        L += [f"Batch {e['batch']}, {e['engine_steps']} steps: {e['decode_us_per_step']:.0f} µs "
              f"per step inside the runner's `decode` ({e['ort_us_per_step']:.0f} µs inside "
              f"onnxruntime, prefill included), {e['overhead_us_per_step']:.0f} µs per step "
              f"outside it (sampling, detokenizer, stop checks, events, bookkeeping): "
              f"{e['overhead_us_per_step'] / period:.0%} of the step period (unprofiled run).",
              "", "| function | calls | tottime s | cumtime s |", "|---|---|---|---|"]
        for row in e["top"][:15]:
            L.append(f"| `{row['function']}` | {row['calls']} | {row['tottime_s']:.4f} | "
                     f"{row['cumtime_s']:.4f} |")
        L.append("")
    L += ["## 3. Allocations per engine iteration (tracemalloc)", ""]
    for a in data["alloc"]:
        L += [f"Batch {a['batch']}, {a['steps']} iterations: transient peak "
              f"{a['transient_peak_bytes_median']:,} bytes per iteration (median), live growth "
              f"{a['live_growth_bytes_per_step_median']:,} bytes per iteration.", "",
              "| where (growth over the run) | bytes | blocks |", "|---|---|---|"]
        for g in a["top_growth"]:
            L.append(f"| `{g['where']}` | {g['bytes']:,} | {g['blocks']} |")
        L.append("")
    if data.get("findings"):
        L += ["## Findings", "", data["findings"], ""]
    out.write_text("\n".join(L) + "\n")


def run_profile(artifact: str, threads: int, steps: int, batches=(1, 8)) -> dict:
    data = {"model": artifact, "threads": threads, "load_before": os.getloadavg()[0]}
    data["loop"] = [loop_split(artifact, threads, b, steps) for b in batches]
    data["engine"] = [engine_profile(artifact, threads, b, steps) for b in batches]
    data["alloc"] = [engine_allocations(artifact, threads, b, min(steps, 100)) for b in batches]
    data["load_after"] = os.getloadavg()[0]
    return data


def profile_to(artifact: str, out: Path, threads: int, steps: int = 200, batches=(1, 8)
               ) -> dict:
    """Profile ``artifact`` and write ``profile.json`` and ``profile.md`` into ``out``. A
    ``profile-findings.md`` already in ``out`` (hand-written conclusions) is appended to the
    report."""
    data = run_profile(artifact, threads, steps=steps, batches=batches)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    findings = out / "profile-findings.md"
    if findings.is_file():
        data["findings"] = findings.read_text()
    (out / "profile.json").write_text(json.dumps(data, indent=1) + "\n")
    write_report(data, out / "profile.md")
    return data


def main(args) -> int:
    from . import build as B

    name = (args.sizes or "bench-6m").split(",")[0]
    built = B.build(name, Path(args.cache), genai=False, int8=False, threads=args.threads)
    out = Path(args.results) if args.results else committed_results("--profile without --results")
    profile_to(str(built.fp32), out, args.threads, steps=200)
    print((out / "profile.md").read_text())
    return 0

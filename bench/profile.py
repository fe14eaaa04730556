"""Profile of the decode loop (``kvserve bench --profile``): where a decode step's time goes.

1. Raw loop split (OnnxLM + KVBuffers): a timed copy of ``OnnxLM.decode``'s body, per phase:
   capacity check + binding lookup, input fill, ``run_with_iobinding``, ``KVBuffers.append``,
   argmax. Everything outside ``run_with_iobinding`` is Python/numpy overhead.
2. Engine: the real engine thread under cProfile for ``steps`` steps, and the engine's own split
   (time inside ``OnnxLM.decode`` vs the step period, from its metrics hooks).
3. tracemalloc over engine steps: transient peak bytes per step and live growth per step.
Writes ``bench/results/profile.md`` (and ``profile.json``).
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import time
import tracemalloc
from pathlib import Path

from .runners import EngineRunner, LoopRunner, prompts_for


# --- 1. raw loop split -------------------------------------------------------------------------
def loop_split(artifact: str, threads: int, batch: int, steps: int, prompt_len: int = 32
               ) -> dict:
    r = LoopRunner(artifact, threads)
    lm = r.lm
    prompts = prompts_for(batch, prompt_len, r.cfg.vocab_size)
    r.generate(prompts, 8)  # warm-up
    kv, tok = r._start(prompts, prompt_len + steps + 2)
    phases = {"capacity+binding": [], "fill inputs": [], "run_with_iobinding": [],
              "KVBuffers.append": [], "argmax": []}
    sess = lm.sessions["decode"]
    pc = time.perf_counter
    for _ in range(steps):
        positions = kv.used[:batch].copy()
        t0 = pc()
        kv.ensure_capacity(int(kv.used[:batch].max()) + 1)
        binding, ids, pos, logits, rows = lm._binding("decode", kv, batch)
        t1 = pc()
        ids[:, 0] = tok
        pos[:, 0] = positions
        t2 = pc()
        sess.run_with_iobinding(binding)
        t3 = pc()
        kv.append(batch, rows)
        t4 = pc()
        tok = logits[:, 0].argmax(-1)
        t5 = pc()
        for k, a, b in zip(phases, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
            phases[k].append(b - a)
    total = sum(sum(v) for v in phases.values())
    return {"batch": batch, "steps": steps,
            "phases_us": {k: 1e6 * statistics.median(v) for k, v in phases.items()},
            "share": {k: sum(v) / total for k, v in phases.items()},
            "step_us": 1e6 * total / steps}


# --- 2. engine under cProfile ------------------------------------------------------------------
def engine_profile(artifact: str, threads: int, batch: int, steps: int, top: int = 25) -> dict:
    r = EngineRunner(artifact, threads, max_batch=max(batch, 1))
    prompts = prompts_for(batch, 32, r.cfg.vocab_size)
    r.generate(prompts, 8)  # warm-up
    r.metrics.steps.clear()
    prof = cProfile.Profile()
    eng = r.engine
    # profile the engine thread: wrap the loop body the thread runs each iteration
    orig = eng._iteration

    def profiled(admit):
        prof.enable()
        try:
            return orig(admit)
        finally:
            prof.disable()

    eng._iteration = profiled
    t0 = time.perf_counter()
    r.generate(prompts, steps)
    wall = time.perf_counter() - t0
    eng._iteration = orig
    inside = sum(s for _, s in r.metrics.steps)
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s).sort_stats("tottime")
    st.print_stats(top)
    rows = _stats_rows(st, top)
    # the same run without the profiler: the engine's own split
    r.metrics.steps.clear()
    t0 = time.perf_counter()
    r.generate(prompts, steps)
    wall2 = time.perf_counter() - t0
    inside2 = sum(s for _, s in r.metrics.steps)
    n_steps = len(r.metrics.steps)
    r.close()
    return {"batch": batch, "steps": steps, "profiled_wall_s": wall,
            "profiled_decode_s": inside, "wall_s": wall2, "decode_s": inside2,
            "engine_steps": n_steps, "overhead_us_per_step": 1e6 * (wall2 - inside2) / n_steps,
            "decode_us_per_step": 1e6 * inside2 / n_steps, "top": rows}


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
    r.generate(prompts, 8)
    eng = r.engine
    peaks: list[int] = []
    orig = eng._decode_step

    def traced():
        cur0, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        orig()
        cur1, peak = tracemalloc.get_traced_memory()
        peaks.append((peak - cur0, cur1 - cur0))

    eng._decode_step = traced
    tracemalloc.start(1)
    snap0 = tracemalloc.take_snapshot()
    r.generate(prompts, steps)
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    eng._decode_step = orig
    r.close()
    growth = snap1.compare_to(snap0, "lineno")
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
    L += ["## 1. Raw loop (OnnxLM.decode body, timed per phase)", "",
          "| batch | step µs | capacity+binding | fill inputs | run_with_iobinding | "
          "KVBuffers.append | argmax | outside ORT |", "|---|---|---|---|---|---|---|---|"]
    for s in data["loop"]:
        p, sh = s["phases_us"], s["share"]
        L.append(f"| {s['batch']} | {s['step_us']:.0f} | " + " | ".join(
            f"{p[k]:.1f} µs ({sh[k]:.0%})" for k in p) +
            f" | {1 - sh['run_with_iobinding']:.0%} |")
    L += ["", "## 2. Engine thread (cProfile) and the engine's own split", ""]
    for e in data["engine"]:
        L += [f"Batch {e['batch']}, {e['engine_steps']} steps: {e['decode_us_per_step']:.0f} µs "
              f"per step inside `OnnxLM.decode`, {e['overhead_us_per_step']:.0f} µs per step "
              f"outside it (sampling, detokenizer, stop checks, events, bookkeeping): "
              f"{e['overhead_us_per_step'] / (e['overhead_us_per_step'] + e['decode_us_per_step']):.0%}"
              f" of the step period (unprofiled run).", "",
              "| function | calls | tottime s | cumtime s |", "|---|---|---|---|"]
        for row in e["top"][:15]:
            L.append(f"| `{row['function']}` | {row['calls']} | {row['tottime_s']:.4f} | "
                     f"{row['cumtime_s']:.4f} |")
        L.append("")
    L += ["## 3. Allocations per engine decode step (tracemalloc)", ""]
    for a in data["alloc"]:
        L += [f"Batch {a['batch']}, {a['steps']} steps: transient peak "
              f"{a['transient_peak_bytes_median']:,} bytes per step (median), live growth "
              f"{a['live_growth_bytes_per_step_median']:,} bytes per step.", "",
              "| where (growth over the run) | bytes | blocks |", "|---|---|---|"]
        for g in a["top_growth"]:
            L.append(f"| `{g['where']}` | {g['bytes']:,} | {g['blocks']} |")
        L.append("")
    if data.get("findings"):
        L += ["## Findings", "", data["findings"], ""]
    out.write_text("\n".join(L) + "\n")


def run_profile(artifact: str, threads: int, steps: int, batches=(1, 8)) -> dict:
    import os

    data = {"model": artifact, "threads": threads, "load_before": os.getloadavg()[0]}
    data["loop"] = [loop_split(artifact, threads, b, steps) for b in batches]
    data["engine"] = [engine_profile(artifact, threads, b, steps) for b in batches]
    data["alloc"] = [engine_allocations(artifact, threads, b, min(steps, 100)) for b in batches]
    data["load_after"] = os.getloadavg()[0]
    return data


def main(args) -> int:
    from . import build as B
    from .main import RESULTS

    name = (args.sizes or "bench-6m").split(",")[0]
    built = B.build(name, Path(args.cache), genai=False, int8=False, threads=args.threads)
    data = run_profile(str(built.fp32), args.threads, steps=200)
    findings = RESULTS / "profile-findings.md"
    if findings.is_file():
        data["findings"] = findings.read_text()
    out = Path(args.results) if args.results else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(data, indent=1) + "\n")
    write_report(data, out / "profile.md")
    print((out / "profile.md").read_text())
    return 0


"""Results JSON -> markdown tables: the generated block of docs/benchmarks.md (between the
markers) and ``tables.md`` in a results directory.

Pure functions of the JSON: ``kvserve bench --render-only`` rebuilds everything from
``bench/results/*.json`` without measuring anything.
"""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

from .figures import (blocks, decode_columns, fmt, get, paired, per_round, ratio,
                      score_roofline, tok_s)
from .report_speed import prefix_chat_tables, spec_table
from .targets import grid, targets

__all__ = ["START", "END", "render", "update_doc", "load_results", "targets", "paired",
           "per_round", "decode_columns"]

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
WIDTH = 100  # prose lines are wrapped to this width (tables are not)

RUNNER_LABELS = {
    "engine": "kvserve engine (in-process, server/engine.py)",
    "loop": "kvserve raw loop (artifact runner + KV cache, argmax)",
    "engine_int8": "kvserve engine, int8 artifact",
    "engine_int4": "kvserve engine, int4 artifact",
    "engine_on": "kvserve engine, prefix cache and speculation on (server defaults)",
    "llamacpp": "llama.cpp (llama-cpp-python 0.3.36, f32 GGUF)",
    "llamacpp_q8": "llama.cpp, q8_0 GGUF",
    "llamacpp_q4": "llama.cpp, q4_0 GGUF",
    "matmuls": "kvserve's matrix products alone, fp32 (its kernels' floor: bench/runner_floor.py)",
    "matmuls_int8": "kvserve's matrix products alone, int8",
    "matmuls_int4": "kvserve's matrix products alone, int4",
    "genai": "onnxruntime-genai 0.18 (Generator)",
    "torch": "kvserve torch eager (model/generate.py)",
    "hf": "transformers eager (LlamaForCausalLM.generate)",
}


def label(name: str, res: dict | None = None) -> str:
    """A runner's row label; an int4 artifact's says its block size (``res``: its results)."""
    return RUNNER_LABELS.get(name, name) + blocks(res)


ORDER = ["engine", "loop", "engine_int8", "engine_int4", "matmuls", "matmuls_int8",
         "matmuls_int4", "genai", "llamacpp", "llamacpp_q8", "llamacpp_q4", "torch", "hf"]


def _wrap(lines: list[str]) -> list[str]:
    """Prose, list items and footnotes wrapped to WIDTH (never inside a word); table rows and
    headings as they are."""
    out = []
    for line in lines:
        if len(line) <= WIDTH or line.startswith(("|", "#")):
            out.append(line)
            continue
        m = re.match(r"(- |\d+\. )", line)
        out += textwrap.wrap(line, WIDTH, subsequent_indent=" " * len(m.group(1)) if m else "",
                             break_long_words=False, break_on_hyphens=False)
    return out


# --- markdown ----------------------------------------------------------------------------------
def _turns(results: dict[str, dict]) -> str:
    """How the runners were measured, and how far one runner's turns at a cell spread."""
    rounds = max((s.get("meta", {}).get("rounds", 0) for s in results.values()), default=0)
    if not rounds:
        return ""
    spread = sorted(max(t) / min(t) - 1 for s in results.values()
                    for v in s.get("runners", {}).values()
                    for c in (v.get("decode") or {}).values()
                    if len(t := [x for x in c.get("turns_tok_s") or [] if x]) > 1)
    text = (f". Every runner is loaded once, in its own process, and the runners take turns "
            f"cell by cell in alternating order (`bench/turns.py`); the tables give each "
            f"runner's best of {rounds} turns, and a target's ratio is the median over rounds "
            f"of the two runners' turns in the same round (measured seconds apart)")
    settled = sorted({m["settle_seconds"] for s in results.values()
                      for m in (s.get("meta") or {}, s.get("speed_meta") or {})
                      if "settle_seconds" in m})
    if settled:  # (runs before 2026-12-02 04:46 UTC did not pause)
        text += (f"; each turn started after a {'/'.join(f'{x:g}' for x in settled)} s pause "
                 f"(`--settle`: the runner before it leaves onnxruntime's threads spinning), in "
                 f"the runs that record one")
    if spread:
        text += (f" (a runner's turns at one decode cell differed by a median "
                 f"{spread[len(spread) // 2]:.0%}, at most {spread[-1]:.0%}: this machine's "
                 f"speed drifts)")
    return text


def render(results: dict[str, dict]) -> str:
    """The whole generated block (also written to ``tables.md`` in the results directory)."""
    metas = [s.get("meta", {}) for s in results.values()]
    meta = metas[0] if metas else {}
    lines = ["## Results", ""]
    if meta:
        loads = ", ".join(f"{k}: {fmt(get(s, 'meta', 'load_before'), 2)} → "
                          f"{fmt(get(s, 'meta', 'load_after'), 2)}"
                          for k, s in results.items())
        versions = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items())
        lines += [
            f"Measured by `kvserve bench{' --quick' if meta.get('quick') else ''}` on "
            f"{meta.get('machine', '?')}, {meta.get('date', '?')}; 1-minute load average "
            f"before → after each size: {loads} (it counts this benchmark's own runner "
            f"processes too). Versions: {versions or '?'}. "
            f"Random-init Llama weights (seed {meta.get('seed')}), the same weights for "
            f"every runner (greedy outputs agree: {_agree(results)}). Greedy, 32-token "
            f"prompt; tok/s = batch × new tokens / wall time of the whole call "
            f"(prefill included), after a warm-up"
            f"{_turns(results)}; 2 intra-op threads everywhere.", ""]
    for key, size in results.items():
        lines += _size_tables(key, size)
    ts = targets(results)
    if ts:
        lines += ["### Targets", ""] + grid(ts) + [""]
    lines += ["Runners: **engine** = `server/engine.py` driven in-process (all requests "
                   "submitted together, tokens collected from the handles: sampling, "
                   "detokenizer, stop checks included); **loop** = the artifact's runner "
                   "(`kvserve.artifact.load_lm`: `prefill`, then `decode` on its KV cache) "
                   "with `argmax`, nothing else. Profile of the decode loop: "
                   "`bench/results/profile.md`.", ""]
    return "\n".join(_wrap(lines))


def _agree(results: dict) -> str:
    out = []
    for key, size in results.items():
        samples = {r: v.get("sample_tokens") for r, v in size.get("runners", {}).items()
                   if v.get("sample_tokens") and r != "engine_int8"}  # int8: other weights
        if len(samples) > 1:
            first = next(iter(samples.values()))
            same = all(s == first for s in samples.values())
            out.append(f"{key} {'yes' if same else 'NO'} ({'/'.join(samples)})")
    return "; ".join(out) or "not checked"


def _size_tables(key: str, size: dict) -> list[str]:
    cols = decode_columns(size)
    if not cols:  # (the trained model's results: speculation only)
        return [f"### {size.get('label', key)}", *_speed_meta(size), *prefix_chat_tables(size),
                *spec_table(size), ""]
    return _decode_tables(key, size, cols) + _speed_meta(size) + prefix_chat_tables(size) \
        + spec_table(size) + [""]


def _speed_meta(size: dict) -> list[str]:
    """Which figures of a size came from later runs merged into its results."""
    out = []
    by_run: dict[str, list[str]] = {}
    for r, m in (size.get("runners_meta") or {}).items():
        by_run.setdefault(m.get("date"), []).append(r)
    for date, names in by_run.items():
        m = size["runners_meta"][names[0]]
        out += ["", f"The rows of {', '.join(names)} above were measured by a later "
                f"`kvserve bench --runners {','.join(names)}` run ({date}, 1-minute load average "
                f"{fmt(m.get('load_before'), 2)} → {fmt(m.get('load_after'), 2)}, best of "
                f"{m.get('rounds')} turns; the gRPC server with its defaults, prefix cache and "
                f"speculation on)."]
    m = size.get("speed_meta")
    if m:
        out += ["", f"The prefix cache's and speculation's cells below were measured by a later "
                f"`kvserve bench --speed-only` run ({m.get('date')}, 1-minute load average "
                f"{fmt(m.get('load_before'), 2)} → {fmt(m.get('load_after'), 2)}, best of "
                f"{m.get('rounds')} turns)."]
    return out


def _decode_tables(key: str, size: dict, cols: list[str]) -> list[str]:
    runners = size.get("runners", {})
    # (engine_on runs only the speed cells: no row here)
    names = [r for r in ORDER if r in runners and (r != "engine_on" or runners[r].get("decode"))]
    lines = [f"### {size.get('label', key)}", "",
             "Decode tok/s (batch × new tokens):", "",
             "| runner | " + " | ".join(cols) + " | peak RSS MB |",
             "|---|" + "---|" * (len(cols) + 1)]
    for r in names:
        cells = [fmt(tok_s(size, r, c)) for c in cols]
        rss = None if r.startswith("matmuls") else runners[r].get("rss_peak_mb")  # (not a
        # server: bench/runner_floor.py)
        lines.append(f"| {label(r, runners[r])} | " + " | ".join(cells) + f" | {fmt(rss)} |")
    errs = [f"{r}: {runners[r]['error'].strip().splitlines()[-1][:200]}" for r in runners
             if runners[r].get("error")]
    if errs:
        lines += ["", "Failed runners: " + "; ".join(errs)]
    timed = [r for r in names if runners[r].get("ttft_ms") or runners[r].get("itl_ms")]
    if timed:
        lines += ["", "Latency (ms): time to first token (prompt 32 / 512), inter-token p50 / "
                  "p99 (batch 1, 128 tokens), decode step at position 16 / 256 / 1000:", "",
                  "| runner | TTFT 32 | TTFT 512 | ITL p50 | ITL p99 | step@16 | step@256 | "
                  "step@1000 |", "|---|---|---|---|---|---|---|---|"]
    for r in timed:
        v = runners[r]
        t, i, s = v.get("ttft_ms", {}), v.get("itl_ms", {}), v.get("step_ms", {})
        lines.append(f"| {label(r, v)} | {fmt(t.get('32'), 2)} | "
                     f"{fmt(t.get('512'), 1)} | {fmt(i.get('p50'), 2)} | "
                     f"{fmt(i.get('p99'), 2)} | {fmt(s.get('16'), 2)} | "
                     f"{fmt(s.get('256'), 2)} | {fmt(s.get('1000'), 2)} |")
    score = [(r, runners[r]["score"]) for r in names if runners[r].get("score")]
    if score:
        sc = score[0][1]
        lines += ["", f"Score ({sc['sequences']} sequences × {sc['tokens']} tokens): "
                  + ", ".join(f"{RUNNER_LABELS.get(r, r).split(' (')[0]} "
                              f"{fmt(s['tok_s'])} tok/s" for r, s in score)]
    g = get(runners, "grpc", "grpc")
    if g:
        e1 = tok_s(size, "engine", "1x128")
        lines += ["", f"gRPC (`kvserve serve` subprocess + Python client, 128 new tokens): "
                  f"single stream {fmt(g['single_tok_s'])} tok/s end to end vs in-process "
                  f"engine {fmt(e1)} tok/s; {g['concurrent_streams']} concurrent streams "
                  f"{fmt(g['concurrent_tok_s'])} tok/s aggregate; server peak RSS "
                  f"{fmt(g['server_rss_peak_mb'])} MB."]
    rf = size.get("roofline")
    if rf:
        bw = get(rf, "bandwidth", "gbps")
        for prec in ("fp32", "int8"):
            if prec not in rf:
                continue
            rb = rf[prec]["read_bytes"]
            roof = bw * 1e9 / rb if bw else None
            r = "engine" if prec == "fp32" else "engine_int8"
            got = tok_s(size, r, "1x128")
            steady = get(rf, prec, "steady_tok_s")
            lines += ["", f"Memory roofline ({prec}): a decode step reads "
                      f"{rb / 1e6:,.1f} MB of weights (initializers minus the embedding "
                      f"table); read bandwidth {fmt(bw, 1)} GB/s (numpy sum over "
                      f"{rf['bandwidth']['array_mb']} MB, best of {rf['bandwidth']['repeats']})"
                      f" → roofline {fmt(roof)} tok/s at batch 1; engine reaches "
                      f"{fmt(got)} tok/s = {fmt(ratio(got, roof), 2)} of it"
                      + (f" (steady-state decode step: {fmt(steady)} tok/s = "
                         f"{fmt(ratio(steady, roof), 2)})" if steady else "") + "."
                      + ((" Above 1: the weights fit in L3 (32 MiB) and are served from "
                          "cache, not DRAM." if rb < 32 * (1 << 20) else
                          " Above 1: the numpy sum under-measures the read bandwidth the "
                          "matmul kernels reach; read it as at the roofline.")
                         if (ratio(got, roof) or 0) > 1 else "")]
    roof = score_roofline(size)
    if roof:
        got = get(size, "runners", "engine", "score", "tok_s")
        by = get(size, "roofline", "compute", "gflops_by_shape") or {}
        lines += ["", f"Compute roofline (fp32, Score): a scored token costs "
                  f"{roof['mflop']:,.1f} MFLOP (every MatMul weight twice, the lm_head "
                  f"included, and causal attention); onnxruntime's fp32 MatMul ran at up to "
                  f"{roof['gflops']:,.0f} GFLOP/s here ("
                  + ", ".join(f"{k}: {v:,.0f}" for k, v in by.items())
                  + f") → roofline {fmt(roof['tok_s'])} tok/s; the engine's Score reaches "
                  f"{fmt(got)} tok/s = {fmt(ratio(got, roof['tok_s']), 2)} of it."]
    if size.get("int8_perplexity"):
        p = size["int8_perplexity"]
        lines += ["", f"int8 perplexity (manifest, {p.get('eval_tokens')} tokens): fp32 "
                  f"{fmt(p.get('fp32'), 1)} → int8 {fmt(p.get('int8'), 1)} "
                  f"({p.get('relative_change', 0):+.2%}); random-init weights, so both sit "
                  f"near the vocabulary size."]
    return lines


def update_doc(doc: Path, section: str, start: str = START, end: str = END) -> None:
    """Replace what is between the markers of ``doc`` (appending the markers when missing);
    the bench's by default, another generated block's when given."""
    text = doc.read_text() if doc.exists() else ""
    if start not in text or end not in text:
        text = text.rstrip("\n") + f"\n\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{start}\n{section.strip()}\n{end}{tail}")


def load_results(results_dir: Path) -> dict[str, dict]:
    out = {}
    for p in sorted(Path(results_dir).glob("*.json")):
        d = json.loads(p.read_text())
        if isinstance(d, dict) and "runners" in d:
            out[d.get("size", p.stem)] = d
    order = ["bench-6m", "bench-100m", "small", "trained", "bench-6m+llamacpp",
             "bench-100m+llamacpp"]
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order
                       else len(order)))

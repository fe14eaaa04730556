"""Decode step cost against position, and what attention diagnostics cost (a script).

    python bench/decode_cost.py [--preset small | --artifact DIR] [--batch 1 16]
                                [--threads N] [--steps 200] [--profile] [--out DIR]
    python -m kvserve.bench.decode_cost ...   (the same)

Measured through the server's path (the artifact's runner from ``kvserve.artifact.load_lm``,
its KV cache, ``decode``) on a random-init model of ``--preset`` exported with
``export_artifacts`` (attention diagnostics included), or on ``--artifact``:

1. step time against position, per batch size: the targets are step(1000) / step(16) <= 1.15
   at batch 1 and <= 1.5 at batch 16 (on the bench-100m model: ``--preset bench-100m``);
2. what attention diagnostics cost: the plain graph's step next to the step of the graph that
   returns attention weights (fused artifacts: GroupQueryAttention's ``qk_output`` variant).
   A request that does not ask runs the plain graph, on a runner that never loaded the
   diagnostics graph (a fused runner loads it lazily, on the first request that asks), so
   "not asked" is the plain cells.

Every slot of a batch sits at the same position (one sequence prefilled, then copied to the
other slots with the cache's ``move``). Each timed step runs at exactly its position: after a
step every slot is rewound by one token (``cache.used[b] -= 1``), so all ``--steps`` samples
of a cell see the same past. Cells are interleaved in rounds of ``--block`` steps (the first
step of each round untimed: switching caches rebuilds the runner's IO binding) so that machine
noise spreads over all of them instead of biasing one. The Python overhead of a step is its
call time minus the time inside onnxruntime (the runner's ``ort_seconds``).

Attention columns: a fused step attends over each slot's own rows (position + 1); the portable
decode graph attends over the whole buffer (its capacity, rounded up to 128 rows, + 1).

``--profile`` adds onnxruntime's per-operator profile of the plain step at the first and last
position (session options with ``enable_profiling``, passed to ``load_lm``).

Results (``decode_cost.json`` and ``decode_cost.md``) go to ``--out`` (a directory, or a
``.json`` file path); by default a fresh directory under ``.bench/decode_cost/``. The committed
figures in ``bench/results/`` are only written when ``--out`` names them.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvserve.bench.common import CACHE, committed_results, cpu_model
from kvserve.export.logs import quiet_torch_exporter

TARGETS = {1: 1.15, 16: 1.5}  # batch -> max step(last position) / step(first position)
PLAIN, ASKED = "plain", "attention"
LABELS = {PLAIN: "plain graph (attention not asked)",
          ASKED: "attention graph (attention asked)"}


def machine_info(threads: int) -> dict:
    import onnxruntime as ort

    return {"cpu_model": cpu_model(), "cores": os.cpu_count(),
            "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None,
            "onnxruntime": ort.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "intra_op_threads": threads, "loadavg_start": list(os.getloadavg())}


def build_artifact(workdir: Path, preset: str, threads: int, seed: int) -> Path:
    import torch

    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.checkpoint import save_checkpoint
    from kvserve.model.config import preset as make_preset
    from kvserve.model.transformer import Transformer

    quiet_torch_exporter()
    torch.manual_seed(seed)
    model = Transformer(make_preset(preset)).eval()
    ckpt = save_checkpoint(workdir / "ckpt", model)
    t0 = time.perf_counter()
    out = export_artifacts(ckpt, workdir / "artifact", attention=True, progress=False,
                           threads=threads)
    print(f"exported {preset} ({model.num_parameters() / 1e6:.2f} M parameters) in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def filled_cache(lm, batch: int, position: int, prompt: np.ndarray):
    """A cache of ``batch`` slots, each holding ``prompt[:position]``: one sequence prefilled
    (in chunks whose logits stay under the server's ``score_chunk_floats``, as the engine
    prefills), then copied to the other slots."""
    from kvserve.server.config import ServerConfig

    cache = lm.new_cache(batch, capacity=position + 1)
    chunk = max(1, ServerConfig().score_chunk_floats // lm.cfg.vocab_size)
    ids = [int(t) for t in prompt[:position]]
    lm.prefill(cache, 0, [ids[:chunk]])
    for a in range(chunk, position, chunk):
        lm.extend(cache, 0, ids[a:a + chunk])
    for b in range(1, batch):
        cache.move(0, b)
    return cache


def rewind(cache, n: int) -> None:
    """Slots [0, n) forget their last token (the step just timed)."""
    cache.used[:n] -= 1
    mask = getattr(cache, "mask", None)  # the portable cache's attention mask marks rows too
    if mask is not None:
        mask[np.arange(n), cache.used[:n]] = 0


class Cell:
    """One (graph, batch, position) measurement: slots [0, batch) of a cache whose slots all
    sit at ``position`` (cells of the same graph and position share it: each step rewinds)."""

    def __init__(self, graph: str, lm, cache, batch: int, position: int, token: int):
        self.graph, self.lm, self.cache = graph, lm, cache
        self.batch, self.position = batch, position
        self.attention = graph == ASKED
        self.tokens = np.full(batch, token, np.int64)
        self.total: list[float] = []
        self.ort: list[float] = []

    def step(self, record: bool) -> None:
        lm = self.lm
        ort0 = lm.ort_seconds
        t0 = time.perf_counter()
        lm.decode(self.cache, self.batch, self.tokens, attention=self.attention)
        dt = time.perf_counter() - t0
        inside = lm.ort_seconds - ort0
        rewind(self.cache, self.batch)  # the next step runs at the same position again
        if record:
            self.total.append(dt)
            self.ort.append(inside)

    def attention_columns(self) -> int:
        if self.lm.kind == "portable":  # the decode graph reads the whole buffer
            return self.cache.capacity + 1
        return self.position + 1

    def summary(self) -> dict:
        tot, ort = np.array(self.total), np.array(self.ort)
        over = tot - ort
        return {"graph": self.graph, "label": LABELS[self.graph], "batch": self.batch,
                "position": self.position, "attention_columns": self.attention_columns(),
                "steps": len(tot),
                "median_ms": 1e3 * float(np.median(tot)),
                "p10_ms": 1e3 * float(np.percentile(tot, 10)),
                "p90_ms": 1e3 * float(np.percentile(tot, 90)),
                "min_ms": 1e3 * float(tot.min()),
                "median_ort_ms": 1e3 * float(np.median(ort)),
                "median_python_overhead_us": 1e6 * float(np.median(over)),
                "python_overhead_share": float(np.median(over / tot))}


def runners(art: Path, threads: int, attention: bool) -> dict:
    """graph -> runner: the plain one never loads the diagnostics graph."""
    from kvserve.artifact.loader import load_lm

    out = {PLAIN: load_lm(art, provider="cpu", threads=threads, attention=False)}
    if attention:
        diag = load_lm(art, provider="cpu", threads=threads, attention=True)
        if diag.has_attention:
            out[ASKED] = diag
        else:
            print("this artifact has no attention-diagnostics graph: measuring the plain graph "
                  "only", file=sys.stderr)
    return out


def measure(art: Path, batches: list[int], positions: list[int], steps: int, warmup: int,
            block: int, threads: int, seed: int, attention: bool = True) -> tuple[list, str]:
    lms = runners(art, threads, attention)
    vocab = lms[PLAIN].cfg.vocab_size
    prompt = np.random.default_rng(seed).integers(2, vocab, max(positions) + 1)
    caches = {(g, p): filled_cache(lm, max(batches), p, prompt) for g, lm in lms.items()
              for p in positions}
    cells = [Cell(g, lm, caches[(g, p)], b, p, int(prompt[p])) for b in batches
             for p in positions for g, lm in lms.items()]
    for c in cells:
        for _ in range(warmup):
            c.step(record=False)
    rounds = (steps + block - 1) // block
    for r in range(rounds):
        order = cells if r % 2 == 0 else cells[::-1]
        for c in order:
            c.step(record=False)  # a new cache for the runner: its binding is rebuilt here
            for _ in range(min(block, steps - r * block)):
                c.step(record=True)
    return [c.summary() for c in cells], lms[PLAIN].kind


def profile_ops(art: Path, batches: list[int], positions: list[int], threads: int,
                steps: int, seed: int) -> dict:
    """onnxruntime's profiler over the plain decode step at each (batch, position): median ms
    per step per operator type. The profiler's own per-node cost inflates these figures;
    compare them across positions, not with the unprofiled step times."""
    from kvserve.artifact.loader import load_lm
    from kvserve.artifact.providers import session_options

    out = {}
    with tempfile.TemporaryDirectory(prefix="decode_cost_prof-") as tmp:
        for b in batches:
            for p in positions:
                so = session_options(threads)
                so.enable_profiling = True
                so.profile_file_prefix = str(Path(tmp) / f"b{b}-p{p}")
                lm = load_lm(art, provider="cpu", threads=threads, attention=False, options=so)
                prompt = np.random.default_rng(seed).integers(2, lm.cfg.vocab_size, p + 1)
                cell = Cell(PLAIN, lm, filled_cache(lm, b, p, prompt), b, p, int(prompt[p]))
                for _ in range(steps):
                    cell.step(record=True)
                sessions = [lm.session(False)] if lm.kind == "fused" else \
                    [lm.sessions["decode"]]
                events = []
                for sess in sessions:
                    events += json.loads(Path(sess.end_profiling()).read_text())
                out[f"b{b}@{p}"] = _per_op(events, steps)
                del cell, lm
    return out


def _per_op(events: list[dict], steps: int) -> dict[str, float]:
    """Median ms per run by operator type over the last ``steps`` runs (the decode steps; the
    runs before them filled the cache)."""
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") == "Session" and e.get("name") == "model_run")[-steps:]
    per_run: list[dict[str, float]] = [{} for _ in runs]
    starts = [r[0] for r in runs]
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            i = int(np.searchsorted(starts, e["ts"], side="right")) - 1
            if i >= 0 and e["ts"] <= runs[i][1]:
                op = e.get("args", {}).get("op_name", "?")
                per_run[i][op] = per_run[i].get(op, 0.0) + e["dur"] / 1e3
    ops = set().union(*per_run) if per_run else set()
    per_op = {op: float(np.median([r.get(op, 0.0) for r in per_run])) for op in ops}
    return dict(sorted(per_op.items(), key=lambda kv: -kv[1]))


def arithmetic(cfg, rows: list[dict], positions: list[int]) -> dict:
    """Multiply-accumulates per decode step and sequence: the weights' (fixed) and attention's
    (2 * layers * heads * head_dim per attended column: QK^T and PV). Their ratio bounds the
    step-time ratio for any implementation that runs both at the same efficiency."""
    d, hd, H, Hkv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    ffn = d * 2 * cfg.d_ff + cfg.d_ff * d if cfg.ffn == "swiglu" else 2 * d * cfg.d_ff
    weights = cfg.n_layers * (d * (H + 2 * Hkv) * hd + H * hd * d + ffn) + d * cfg.vocab_size
    cols = {r["position"]: r["attention_columns"] for r in rows}
    per_col = 2 * cfg.n_layers * H * hd
    attn = {p: per_col * cols[p] for p in positions}
    lo, hi = positions[0], positions[-1]
    return {"weight_macs": weights, "attention_macs": {str(p): attn[p] for p in positions},
            "mac_ratio": (weights + attn[hi]) / (weights + attn[lo]),
            "mac_ratio_unpadded": (weights + per_col * (hi + 1)) / (weights + per_col * (lo + 1))}


def ratios(rows: list[dict], batches: list[int], positions: list[int]) -> dict:
    """Per batch: step(last) / step(first) position per graph (medians and fastest steps), and
    attention asked / not asked per position."""
    med = {(r["graph"], r["batch"], r["position"]): r["median_ms"] for r in rows}
    best = {(r["graph"], r["batch"], r["position"]): r["min_ms"] for r in rows}
    graphs = list(dict.fromkeys(r["graph"] for r in rows))
    lo, hi = positions[0], positions[-1]
    out = {}
    for b in batches:
        d = {}
        for g in graphs:
            d[f"{g}: step({hi}) / step({lo})"] = med[(g, b, hi)] / med[(g, b, lo)]
            d[f"{g}: step({hi}) / step({lo}), fastest steps"] = \
                best[(g, b, hi)] / best[(g, b, lo)]
        if ASKED in graphs:
            for p in positions:
                d[f"attention asked / not asked @ {p}"] = med[(ASKED, b, p)] / \
                    med[(PLAIN, b, p)]
        out[f"batch {b}"] = d
    return out


def targets(rat: dict, batches: list[int], positions: list[int]) -> dict:
    lo, hi = positions[0], positions[-1]
    out = {}
    for b in batches:
        r = rat[f"batch {b}"][f"{PLAIN}: step({hi}) / step({lo})"]
        goal = TARGETS.get(b)
        out[f"batch {b}"] = {"ratio": r, "positions": [lo, hi], "ratio_max": goal,
                             "met": None if goal is None else r <= goal,
                             "applies": goal is not None and (lo, hi) == (16, 1000)}
    return out


def markdown(result: dict) -> str:
    info, rows, positions = result["machine"], result["cells"], result["positions"]
    lo, hi = positions[0], positions[-1]
    L = [f"## Decode step cost, {result['model']} ({result['runtime']} runner)", "",
         f"{info['cpu_model']}, {info['cores']} cores, onnxruntime {info['onnxruntime']}, "
         f"{info['intra_op_threads']} intra-op threads; load average "
         f"{info['loadavg_start'][0]:.2f} -> {info['loadavg_end'][0]:.2f}; "
         f"{result['steps']} timed steps per cell.", "",
         "| graph | batch | position | attention columns | median ms/step | p10-p90 ms | "
         "inside onnxruntime ms | Python overhead µs (share) |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["graph"], r["batch"], r["position"])):
        L.append(f"| {r['label']} | {r['batch']} | {r['position']} | {r['attention_columns']} "
                 f"| {r['median_ms']:.3f} | {r['p10_ms']:.3f}-{r['p90_ms']:.3f} | "
                 f"{r['median_ort_ms']:.3f} | {r['median_python_overhead_us']:.0f} "
                 f"({r['python_overhead_share']:.0%}) |")
    L.append("")
    for batch, d in result["ratios"].items():
        L += [f"- {batch}: " + "; ".join(f"{k} {v:.3f}" for k, v in d.items())]
    L.append("")
    for batch, t in result["target"].items():
        goal = "no target" if t["ratio_max"] is None else \
            f"target <= {t['ratio_max']}: {'met' if t['met'] else 'NOT met'}" + \
            ("" if t["applies"] else " (the target is for positions 16 -> 1000)")
        L.append(f"- {batch}: plain step({hi}) / step({lo}) = {t['ratio']:.3f} ({goal})")
    a = result["arithmetic"]
    L += ["", f"Arithmetic per sequence: {a['weight_macs'] / 1e6:.2f} M weight MACs per step "
          f"+ attention {a['attention_macs'][str(lo)] / 1e6:.2f} M @{lo} / "
          f"{a['attention_macs'][str(hi)] / 1e6:.2f} M @{hi}: MAC ratio {a['mac_ratio']:.3f} "
          f"(attending only over the sequence's tokens: {a['mac_ratio_unpadded']:.3f})."]
    prof = result.get("profile_ms_per_step_by_op")
    if prof:
        L += ["", "ms/step by operator (plain graph, onnxruntime profiler: inflated, compare "
              "columns):", ""]
        ops = sorted(set().union(*[set(v) for v in prof.values()]),
                     key=lambda op: -max(v.get(op, 0.0) for v in prof.values()))
        keys = list(prof)
        L += ["| op | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
        for op in ops[:12]:
            L.append(f"| {op} | " + " | ".join(f"{prof[k].get(op, 0.0):.4f}" for k in keys)
                     + " |")
    return "\n".join(L) + "\n"


def output_paths(out: str | None) -> tuple[Path, Path]:
    """(json, markdown) paths: ``out`` a .json file or a directory; by default a fresh
    directory under .bench/decode_cost/."""
    if out is None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
        base = CACHE / "decode_cost"
        base.mkdir(parents=True, exist_ok=True)
        d = Path(tempfile.mkdtemp(prefix=f"{stamp}-", dir=base))
        return d / "decode_cost.json", d / "decode_cost.md"
    p = Path(out)
    if p.suffix == ".json":
        return p, p.with_suffix(".md")
    return p / "decode_cost.json", p / "decode_cost.md"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", help="model preset exported (random init) "
                    "when no --artifact is given (bench-100m: the targets' model)")
    ap.add_argument("--artifact", default=None, help="artifact directory: reused if it "
                    "exists, else the preset is exported there and kept (default: export "
                    "into a temporary directory)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--positions", type=int, nargs="+", default=[16, 256, 1000])
    ap.add_argument("--steps", type=int, default=200, help="timed steps per cell")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps per cell")
    ap.add_argument("--block", type=int, default=20, help="steps per cell per round")
    ap.add_argument("--threads", type=int, default=None,
                    help="onnxruntime intra-op threads (default: the runtime's own choice)")
    ap.add_argument("--no-attention", action="store_true",
                    help="time the plain graph only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="also profile the plain step per operator at the first and last "
                         "position, each batch")
    ap.add_argument("--profile-steps", type=int, default=200)
    ap.add_argument("--out", default=None, help="results directory (or .json file path); "
                    "default: a fresh directory under .bench/decode_cost/")
    ap.add_argument("--update-committed", action="store_true",
                    help="write the committed bench/results/decode_cost.{json,md}")
    args = ap.parse_args(argv)
    if args.update_committed and args.out:
        ap.error("--out and --update-committed exclude each other")
    if args.update_committed:
        args.out = str(committed_results("--update-committed"))
    for name in ("steps", "warmup", "block", "profile_steps"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            ap.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("steps", "warmup", "block", "profile_steps"):
        if getattr(args, name) > 100_000:
            ap.error(f"--{name.replace('_', '-')} must be <= 100000")
    if not all(1 <= b <= 256 for b in args.batch):
        ap.error("--batch must be between 1 and 256")
    if min(args.positions) < 1:
        ap.error("--positions must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    positions, batches = sorted(set(args.positions)), sorted(set(args.batch))

    from kvserve.artifact.providers import session_options
    from kvserve.model.config import ModelConfig

    threads = args.threads or session_options(None).intra_op_num_threads
    info = machine_info(threads)
    with tempfile.TemporaryDirectory(prefix="decode_cost-") as tmp:
        preset = None
        if args.artifact and (Path(args.artifact) / "manifest.json").is_file():
            art, model = Path(args.artifact), str(args.artifact)
        else:
            preset, model = args.preset, f"`{args.preset}` preset (random init)"
            art = build_artifact(Path(tmp), preset, threads, args.seed)
            if args.artifact:
                shutil.copytree(art, args.artifact)
                art = Path(args.artifact)
        cfg = ModelConfig.load(art / "config.json")
        if positions[-1] >= cfg.max_seq_len:
            raise SystemExit(f"decode_cost: position {positions[-1]} does not fit the model "
                             f"(max_seq_len {cfg.max_seq_len})")
        t0 = time.perf_counter()
        rows, kind = measure(art, batches, positions, args.steps, args.warmup, args.block,
                             threads, args.seed, attention=not args.no_attention)
        elapsed = time.perf_counter() - t0
        prof = profile_ops(art, batches, [positions[0], positions[-1]], threads,
                           args.profile_steps, args.seed) if args.profile else None
    info["loadavg_end"] = list(os.getloadavg())
    rat = ratios(rows, batches, positions)
    result = {
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": model, "preset": preset, "runtime": kind,
        "batches": batches, "positions": positions, "steps": args.steps,
        "warmup": args.warmup, "block": args.block, "machine": info,
        "measure_seconds": elapsed, "cells": rows, "ratios": rat,
        "arithmetic": arithmetic(cfg, [r for r in rows if r["batch"] == batches[0]
                                       and r["graph"] == PLAIN], positions),
        "target": targets(rat, batches, positions),
    }
    if prof is not None:
        result["profile_ms_per_step_by_op"] = prof
    out_json, out_md = output_paths(args.out)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    out_md.write_text(text)
    print(text)
    print(f"written {out_json} and {out_md.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

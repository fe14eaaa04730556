"""Decode step cost against position, and what attention diagnostics cost (a script).

    python bench/decode_cost.py [--threads N] [--steps 200] [--out FILE | --update-committed]
    python -m kvserve.bench.decode_cost ...   (the same)

The export issue asks for two things, measured here on a random-init ``small`` preset model
exported with ``export_artifacts`` (attention graphs included), through the server's path
(``OnnxLM.decode`` + ``KVBuffers``) at batch 1:

1. step time at position 1000 <= 1.3x step time at position 16;
2. requests that don't ask for attention weights pay nothing: the plain decode step is timed
   with an artifact loaded without the attention graphs AND with them loaded, next to the
   ``decode_attn`` step that does return them.

Each timed step runs at exactly its position: after a step the slot is rewound by one row
(``used -= 1`` and its mask column cleared), so all ``--steps`` samples of a cell see the same
past length. Cells are interleaved in rounds of ``--block`` steps so that machine noise (other
processes on a shared box) spreads over all of them instead of biasing one. Per-step Python
overhead is the time of ``OnnxLM.decode`` outside ``run_with_iobinding``.

Note on the design: ``KVBuffers`` capacity is rounded up to 128 rows, and the decode graph
attends over the whole buffer (masked), so at position 16 the attention already spans 129
columns and at position 1000 it spans 1025.

``--profile`` adds onnxruntime's per-operator profile of the plain decode step at the first
and last position (where the extra time at long positions goes).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a script: bench/profile.py would shadow the stdlib's `profile`

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "bench" / "results"  # written only with --update-committed
TARGET_RATIO = 1.3


def machine_info(threads: int) -> dict:
    import onnxruntime as ort

    from kvserve.bench.main import cpu_model

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

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    model = Transformer(make_preset(preset)).eval()
    ckpt = save_checkpoint(workdir / "ckpt", model)
    t0 = time.perf_counter()
    out = export_artifacts(ckpt, workdir / "artifact", attention=True, progress=False,
                           threads=threads)
    print(f"exported {preset} ({model.num_parameters() / 1e6:.2f} M parameters) in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


class TimedRun:
    """Wraps a session's run_with_iobinding to time it (the rest of decode is overhead)."""

    def __init__(self, session):
        self.inner = session.run_with_iobinding
        self.last = 0.0
        session.run_with_iobinding = self

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.last = time.perf_counter() - t0
        return out


class Cell:
    """One (runtime, graph, position) measurement with its own KV buffers at batch 1."""

    def __init__(self, label: str, lm, attention: bool, position: int, prompt: np.ndarray):
        from kvserve.server.runtime import KVBuffers

        self.label, self.lm, self.attention, self.position = label, lm, attention, position
        ids = prompt[None, :position]
        pre = lm.prefill(ids, np.ones_like(ids))
        self.kv = KVBuffers(lm.cfg, 1)
        self.kv.load_prompt(0, pre.present, 0, position)
        self.kv.ensure_capacity(position + 1)
        self.token = np.array([int(prompt[position])], dtype=np.int64)
        self.pos = np.array([position], dtype=np.int64)
        name = "decode_attn" if attention else "decode"
        sess = lm.sessions[name]
        self.timer = sess.run_with_iobinding if isinstance(sess.run_with_iobinding, TimedRun) \
            else TimedRun(sess)
        self.total: list[float] = []
        self.run: list[float] = []

    def step(self, record: bool) -> None:
        t0 = time.perf_counter()
        self.lm.decode(self.kv, 1, self.token, self.pos, attention=self.attention)
        dt = time.perf_counter() - t0
        kv = self.kv  # rewind: the next step runs at the same position again
        kv.used[0] -= 1
        kv.mask[0, kv.used[0]] = 0
        if record:
            self.total.append(dt)
            self.run.append(self.timer.last)

    def summary(self) -> dict:
        tot, run = np.array(self.total), np.array(self.run)
        over = tot - run
        return {"label": self.label, "position": self.position,
                "attention_columns": self.kv.capacity + 1, "steps": len(tot),
                "median_ms": 1e3 * float(np.median(tot)),
                "p10_ms": 1e3 * float(np.percentile(tot, 10)),
                "p90_ms": 1e3 * float(np.percentile(tot, 90)),
                "min_ms": 1e3 * float(tot.min()),
                "median_run_ms": 1e3 * float(np.median(run)),
                "median_python_overhead_us": 1e6 * float(np.median(over)),
                "python_overhead_share": float(np.median(over / tot))}


def measure(art: Path, positions: list[int], steps: int, warmup: int, block: int,
            threads: int, seed: int) -> list[dict]:
    from kvserve.server.runtime import OnnxLM

    plain = OnnxLM(art, provider="cpu", threads=threads, attention=False)
    loaded = OnnxLM(art, provider="cpu", threads=threads, attention=True)
    assert not plain.has_attention and loaded.has_attention
    prompt = np.random.default_rng(seed).integers(0, plain.cfg.vocab_size, max(positions) + 1)
    cells = []
    for p in positions:
        cells += [Cell("decode (attention graphs not loaded)", plain, False, p, prompt),
                  Cell("decode (attention graphs loaded, not asked)", loaded, False, p, prompt),
                  Cell("decode_attn (attention asked)", loaded, True, p, prompt)]
    for c in cells:
        for _ in range(warmup):
            c.step(record=False)
    rounds = (steps + block - 1) // block
    for r in range(rounds):
        order = cells if r % 2 == 0 else cells[::-1]
        for c in order:
            for _ in range(block):
                c.step(record=True)
    return [c.summary() for c in cells]


def profile_ops(art: Path, positions: list[int], threads: int, steps: int, seed: int) -> dict:
    """onnxruntime's profiler over the plain decode step at each position: median ms per step
    per operator type. The profiler's own per-node cost inflates these figures; compare them
    across positions, not with the unprofiled step times."""
    import kvserve.server.runtime as rt

    base = rt.session_options

    def with_profiling(threads=None):
        so = base(threads)
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tempfile.gettempdir()) / "decode_cost_prof")
        return so

    out = {}
    rt.session_options = with_profiling
    try:
        for p in positions:
            lm = rt.OnnxLM(art, provider="cpu", threads=threads, attention=False)
            prompt = np.random.default_rng(seed).integers(0, lm.cfg.vocab_size, p + 1)
            cell = Cell("profile", lm, False, p, prompt)
            for _ in range(steps):
                cell.step(record=True)
            path = lm.sessions["decode"].end_profiling()
            events = json.loads(Path(path).read_text())
            Path(path).unlink()
            for name, sess in lm.sessions.items():
                if name != "decode":
                    Path(sess.end_profiling()).unlink(missing_ok=True)
            runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                          if e.get("cat") == "Session" and e.get("name") == "model_run")
            per_run: list[dict[str, float]] = [{} for _ in runs]
            starts = [r[0] for r in runs]
            for e in events:
                if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                    i = int(np.searchsorted(starts, e["ts"], side="right")) - 1
                    if i >= 0:
                        op = e.get("args", {}).get("op_name", "?")
                        per_run[i][op] = per_run[i].get(op, 0.0) + e["dur"] / 1e3
            ops = set().union(*per_run)
            per_op = {op: float(np.median([r.get(op, 0.0) for r in per_run])) for op in ops}
            out[str(p)] = dict(sorted(per_op.items(), key=lambda kv: -kv[1]))
    finally:
        rt.session_options = base
    return out


def arithmetic(cfg, rows: list[dict], positions: list[int]) -> dict:
    """Multiply-accumulates per decode step at batch 1: the weights' (fixed) and attention's
    (2 * layers * heads * head_dim per attended column: QK^T and PV). Their ratio bounds the
    step-time ratio for any implementation that runs both at the same efficiency."""
    d, hd, H, Hkv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    ffn = d * 2 * cfg.d_ff + cfg.d_ff * d if cfg.ffn == "swiglu" else 2 * d * cfg.d_ff
    weights = cfg.n_layers * (d * (H + 2 * Hkv) * hd + H * hd * d + ffn) + d * cfg.vocab_size
    cols = {r["position"]: r["attention_columns"] for r in rows}
    attn = {p: 2 * cfg.n_layers * H * hd * cols[p] for p in positions}
    lo, hi = positions[0], positions[-1]
    return {"weight_macs": weights, "attention_macs": {str(p): attn[p] for p in positions},
            f"mac_ratio_{hi}_{lo}": (weights + attn[hi]) / (weights + attn[lo]),
            f"mac_ratio_{hi}_{lo}_unpadded": (weights + 2 * cfg.n_layers * H * hd * (hi + 1))
            / (weights + 2 * cfg.n_layers * H * hd * (lo + 1))}


def markdown(rows: list[dict], positions: list[int]) -> str:
    lines = ["| graph / runtime | position | attention columns | median ms/step | p10-p90 ms | "
             "run_with_iobinding ms | Python overhead µs (share) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["label"], r["position"])):
        lines.append(f"| {r['label']} | {r['position']} | {r['attention_columns']} | "
                     f"{r['median_ms']:.3f} | {r['p10_ms']:.3f}-{r['p90_ms']:.3f} | "
                     f"{r['median_run_ms']:.3f} | {r['median_python_overhead_us']:.0f} "
                     f"({r['python_overhead_share']:.0%}) |")
    return "\n".join(lines)


def ratios(rows: list[dict], positions: list[int]) -> dict:
    by = {(r["label"], r["position"]): r["median_ms"] for r in rows}
    best = {(r["label"], r["position"]): r["min_ms"] for r in rows}
    lo, hi = positions[0], positions[-1]
    out = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        out[f"{label}: {hi}/{lo}"] = by[(label, hi)] / by[(label, lo)]
        out[f"{label}: {hi}/{lo} (fastest steps)"] = best[(label, hi)] / best[(label, lo)]
    plain = "decode (attention graphs not loaded)"
    loaded = "decode (attention graphs loaded, not asked)"
    asked = "decode_attn (attention asked)"
    for p in positions:
        out[f"loaded-not-asked / not-loaded @ {p}"] = by[(loaded, p)] / by[(plain, p)]
        out[f"attention asked / not asked @ {p}"] = by[(asked, p)] / by[(loaded, p)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--positions", type=int, nargs="+", default=[16, 256, 1000])
    ap.add_argument("--steps", type=int, default=200, help="timed steps per cell")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps per cell")
    ap.add_argument("--block", type=int, default=20, help="steps per cell per round")
    ap.add_argument("--threads", type=int, default=None,
                    help="onnxruntime intra-op threads (default: the runtime's own choice)")
    ap.add_argument("--artifact", default=None, help="artifact directory (with the attention "
                    "graphs): reused if it exists, else exported there and kept (default: "
                    "export into a temporary directory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="also profile the plain decode step per operator at the first and "
                         "last position")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="results JSON (default: a new .bench/results/decode_cost-<UTC time>.json)")
    ap.add_argument("--update-committed", action="store_true",
                    help="write the committed bench/results/decode_cost.json "
                         "(decode_cost_threads<N>.json with --threads N)")
    args = ap.parse_args(argv)
    if args.update_committed and args.out:
        ap.error("--out and --update-committed exclude each other")
    positions = sorted(args.positions)

    from kvserve.model.config import ModelConfig
    from kvserve.server.runtime import session_options

    threads = args.threads or session_options(None).intra_op_num_threads
    info = machine_info(threads)
    with tempfile.TemporaryDirectory(prefix="decode_cost-") as tmp:
        if args.artifact and (Path(args.artifact) / "manifest.json").is_file():
            art = Path(args.artifact)
        else:
            art = build_artifact(Path(tmp), args.preset, threads, args.seed)
            if args.artifact:
                shutil.copytree(art, args.artifact)
                art = Path(args.artifact)
        t0 = time.perf_counter()
        rows = measure(art, positions, args.steps, args.warmup, args.block, threads, args.seed)
        elapsed = time.perf_counter() - t0
        prof = profile_ops(art, [positions[0], positions[-1]], threads, 200, args.seed) \
            if args.profile else None
        arith = arithmetic(ModelConfig.load(art / "config.json"), rows, positions)
    info["loadavg_end"] = list(os.getloadavg())
    rat = ratios(rows, positions)
    plain_ratio = rat[f"decode (attention graphs not loaded): {positions[-1]}/{positions[0]}"]
    result = {
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "preset": args.preset, "batch": 1, "positions": positions, "steps": args.steps,
        "warmup": args.warmup, "block": args.block, "machine": info,
        "measure_seconds": elapsed, "cells": rows, "ratios": rat, "arithmetic": arith,
        "target": {"ratio_max": TARGET_RATIO, "ratio": plain_ratio,
                   "met": plain_ratio <= TARGET_RATIO},
    }
    if prof is not None:
        result["profile_ms_per_step_by_op"] = prof
    if args.update_committed:
        out = COMMITTED / (f"decode_cost_threads{args.threads}.json" if args.threads
                           else "decode_cost.json")
    elif args.out:
        out = Path(args.out)
    else:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        out = REPO / ".bench" / "results" / f"decode_cost-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"## Decode step cost, `{args.preset}` preset, batch 1\n")
    print(f"{info['cpu_model']}, {info['cores']} cores, onnxruntime {info['onnxruntime']}, "
          f"{threads} intra-op threads; load average {info['loadavg_start'][0]:.2f} -> "
          f"{info['loadavg_end'][0]:.2f}\n")
    print(markdown(rows, positions))
    print()
    for k, v in rat.items():
        print(f"- {k}: {v:.3f}")
    print(f"\nstep({positions[-1]}) / step({positions[0]}) = {plain_ratio:.3f} "
          f"(target <= {TARGET_RATIO}): {'met' if plain_ratio <= TARGET_RATIO else 'NOT met'}")
    lo, hi = positions[0], positions[-1]
    print(f"arithmetic: {arith['weight_macs'] / 1e6:.2f} M weight MACs per step + attention "
          f"{arith['attention_macs'][str(lo)] / 1e6:.2f} M @{lo} / "
          f"{arith['attention_macs'][str(hi)] / 1e6:.2f} M @{hi}: MAC ratio "
          f"{arith[f'mac_ratio_{hi}_{lo}']:.3f} (without the 128-row rounding: "
          f"{arith[f'mac_ratio_{hi}_{lo}_unpadded']:.3f})")
    if prof is not None:
        print("\nms/step by operator (plain decode, onnxruntime profiler: inflated, compare "
              "columns):\n")
        ops = sorted(set().union(*[set(v) for v in prof.values()]),
                     key=lambda op: -max(v.get(op, 0.0) for v in prof.values()))
        keys = list(prof)
        print("| op | " + " | ".join(f"@{k}" for k in keys) + " |")
        print("|---|" + "---:|" * len(keys))
        for op in ops[:12]:
            print(f"| {op} | " + " | ".join(f"{prof[k].get(op, 0.0):.4f}" for k in keys) + " |")
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

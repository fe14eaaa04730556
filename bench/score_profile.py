"""Where Score's time goes, against its compute roofline (issue 27, point 4).

    python -m kvserve.bench.score_profile --cache .bench [--sizes 6m,100m] [--rounds 3]
                                          [--update-docs]

On the bench models (``bench/build.py``; built once, never rebuilt here) and the bench's Score
cell (8 sequences x 256 tokens, the engine's own ``score_steps`` with the server's default
``score_chunk_floats``), each round measures, one after the other:

1. the roofline: onnxruntime's fp32 MatMul GFLOP/s at the bench's roofline shapes
   (``bench/main.py``'s ``_roofline``) and at every MatMul shape the Score calls run, in a
   process of its own (``bench/roofline.py``);
2. Score's wall time and its Python-level split: inside onnxruntime's run of the model graph
   (the runner's ``ort_seconds``), the log-softmax of the logits rows (the runner's
   ``log_softmax``), and the rest (cache allocation, binding, gathers, copies, the generator);
3. Score passes on a session with onnxruntime's profiler on (the fastest of two is kept):
   time per op type, the MatMul nodes' achieved GFLOP/s (2 x M x K x N from the shapes the
   profile records) and the attention's.

The figures are the best the run saw (``summarise``: on 2 shared cores a neighbour's burst
takes one of the two threads and halves whatever is measured then, a MatMul or a Score call;
it never speeds one up); each round's own ratio is kept too. The fraction decomposes as

    fraction = inside_ort x matmul_share x matmul_efficiency x flops / matmul_flops

(the share of the wall in the graph, MatMul's share of the graph, MatMul's GFLOP/s in the timed
call over the roofline's, and the roofline's FLOPs per token over those in MatMul nodes:
attention's are counted at MatMul speed by the roofline). Writes
``bench/results/score-profile.json`` and the block between the markers of docs/speed.md with
``--update-docs`` (else under ``--cache``).
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import textwrap
import time
from pathlib import Path

from .common import REPO, RESULTS, committed_results, loadavg, machine, versions

DOC = REPO / "docs" / "speed.md"
OUT = RESULTS / "score-profile.json"
START, END = "<!-- score-profile:start -->", "<!-- score-profile:end -->"
SEQUENCES, TOKENS = 8, 256  # the bench's Score cell (bench/main.py's plan)
SIZES = {"6m": "bench-6m", "100m": "bench-100m"}
PASSES = 2  # profiled Score passes per round (the fastest is kept)


# --- pure parts (tests/bench/test_score_profile.py) --------------------------------------------
def _shape(type_shape: list) -> list[int]:
    return list(type_shape[0].values())[0]


def matmul_flops(args: dict) -> int:
    """2 x M x K x N of a MatMul node event's ``args`` (its first input (..., K), its output
    (..., N); the weight is an initializer, so the profile records only the activation)."""
    x, y = _shape(args["input_type_shape"]), _shape(args["output_type_shape"])
    return 2 * math.prod(y) * x[-1]


def op_shares(events: list[dict], lo: float = 0.0, hi: float = math.inf) -> dict:
    """Per op type: kernel microseconds, calls and share of all nodes' time, for the node events
    of an onnxruntime profile starting in [lo, hi) (microseconds since the session began); the
    graph runs' total; MatMul nodes' FLOPs and GFLOP/s, overall and per M x K x N."""
    ops: dict[str, dict] = {}
    shapes: dict[str, list[float]] = {}
    run_us = 0.0
    for e in events:
        if not lo <= e.get("ts", -1) < hi:
            continue
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            run_us += e["dur"]
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        op = e["args"]["op_name"]
        o = ops.setdefault(op, {"us": 0.0, "calls": 0})
        o["us"] += e["dur"]
        o["calls"] += 1
        if op == "MatMul":
            x, y = _shape(e["args"]["input_type_shape"]), _shape(e["args"]["output_type_shape"])
            s = shapes.setdefault(f"{math.prod(x[:-1])}x{x[-1]}x{y[-1]}", [0.0, 0.0])
            s[0] += e["dur"]
            s[1] += matmul_flops(e["args"])
    nodes = sum(o["us"] for o in ops.values())
    for o in ops.values():
        o["share"] = o["us"] / nodes if nodes else 0.0
    mm_us = sum(s[0] for s in shapes.values())
    mm_flops = sum(s[1] for s in shapes.values())
    return {"ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]["us"])), "nodes_us": nodes,
            "run_us": run_us, "matmul_flops": mm_flops,
            "matmul_gflops": mm_flops / mm_us / 1e3 if mm_us else None,
            "matmul_by_shape": {k: {"us": u, "gflops": f / u / 1e3 if u else None}
                                for k, (u, f) in shapes.items()}}


def run_windows(events: list[dict]) -> list[tuple[float, float]]:
    """(start, end) of every graph run of a profile, in order."""
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") == "Session" and e.get("name") == "model_run")


def roofline(tok_s: float, gflops: float, flops_per_token: float) -> dict:
    """Roofline tok/s at ``gflops`` for a token of ``flops_per_token``, and the fraction of it
    that ``tok_s`` reaches."""
    roof = gflops * 1e9 / flops_per_token
    return {"roofline_tok_s": roof, "fraction": tok_s / roof}


def explained(split: dict, prof: dict, gflops: float, flops_per_token: float, tokens: int
              ) -> dict:
    """The fraction's factors (see the module's docstring). The MatMul nodes' time in the timed
    call is its wall x the share inside onnxruntime x MatMul's share of the graph (the
    profiled pass's); their efficiency is their FLOPs over that time, over the roofline's
    GFLOP/s (so the product is the fraction); ``matmul_efficiency_profiled`` is the profiled
    pass's own. ``ceiling_matmul_at_roofline``: the fraction with the MatMul nodes at the
    roofline's GFLOP/s and everything else as measured (what attention, the other ops, the
    log-softmax and Python leave)."""
    mm = prof["ops"].get("MatMul", {}).get("share", 0.0)
    wall, inside = split["seconds"], split["inside_ort"]
    t_mm = wall * inside * mm
    ideal = flops_per_token * tokens / (gflops * 1e9)  # the call at the roofline
    mm_ideal = prof["matmul_flops"] / (gflops * 1e9)
    eff = mm_ideal / t_mm if t_mm else 0.0
    ratio = flops_per_token * tokens / prof["matmul_flops"] if prof["matmul_flops"] else 0.0
    return {"inside_ort": inside, "matmul_share": mm, "matmul_efficiency": eff,
            "matmul_efficiency_profiled": (prof["matmul_gflops"] or 0.0) / gflops,
            "flops_over_matmul_flops": ratio, "product": inside * mm * eff * ratio,
            "ceiling_matmul_at_roofline": ideal / (wall - t_mm + mm_ideal)}


# attention's nodes: onnxruntime's op, or kvserve's own CPU kernel (artifact.native_attention)
ATTENTION_OPS = ("GroupQueryAttention", "KVAttention")


def attention_gflops(prof: dict, n_layers: int, d_model: int, tokens: int, scored: int
                     ) -> dict | None:
    """Attention's GFLOP/s in a profiled pass of ``scored`` tokens (sequences of
    ``tokens``): on the causal FLOPs the roofline counts (QK and PV over (tokens + 1) / 2
    positions on average), and on what its kernel multiplies: onnxruntime's CPU kernel
    every query row against all ``tokens`` keys, the upper triangle zeroed after the product
    (2 T / (T + 1) times as many); kvserve's each query against the keys up to its own
    position (the causal count). ``op``: the kernel's op type."""
    found = {op: prof["ops"].get(op, {}).get("us", 0) for op in ATTENTION_OPS}
    us = sum(found.values())
    if not us:
        return None
    op = max(found, key=found.get)
    causal = 4.0 * n_layers * d_model * (tokens + 1) / 2 * scored
    computed = causal if op == "KVAttention" else causal * 2 * tokens / (tokens + 1)
    return {"op": op, "causal_gflops": causal / us / 1e3, "computed_gflops": computed / us / 1e3}


ATTENTION_KERNELS = {
    "GroupQueryAttention": "onnxruntime's CPU GroupQueryAttention: per sequence and head, every "
                           "query row times every key, the upper triangle zeroed after the "
                           "product, then the softmax and the rotary embedding",
    "KVAttention": "kvserve's own CPU kernel, ai.kvserve.KVAttention: each query row against "
                   "the keys up to its own position, one query at a time (the same arithmetic "
                   "in every call shape), the rotary embedding included"}


def same_shape_efficiency(prof: dict, peak_by_shape: dict) -> float | None:
    """The MatMul nodes' time at the one-node graph's GFLOP/s of each node's own shape over
    their measured time (1.0: each runs as fast as that MatMul alone)."""
    ideal = actual = 0.0
    for shape, s in prof["matmul_by_shape"].items():
        if not s["gflops"] or shape not in peak_by_shape:
            return None
        ideal += s["gflops"] * s["us"] / peak_by_shape[shape]
        actual += s["us"]
    return ideal / actual if actual else None


# --- measurement -------------------------------------------------------------------------------
class _Timed:
    """The engine's Score cell with its Python-level split: ``lm.log_softmax`` wrapped (an
    instance attribute over the runner's method), ``lm.ort_seconds`` read around the call."""

    def __init__(self, art: Path, threads: int):
        from .runner_base import prompts_for
        from .runner_kvserve import EngineRunner

        self.r = EngineRunner(str(art), threads)
        self.lm = self.r.lm
        self.seqs = prompts_for(SEQUENCES, TOKENS, self.lm.cfg.vocab_size, seed=11).tolist()
        self.ls_seconds = 0.0
        inner = self.lm.log_softmax

        def log_softmax(rows):
            t0 = time.perf_counter()
            try:
                return inner(rows)
            finally:
                self.ls_seconds += time.perf_counter() - t0

        self.lm.log_softmax = log_softmax
        self.r.score(self.seqs[:1])  # warm-up

    def once(self) -> dict:
        ort0, self.ls_seconds = self.lm.ort_seconds, 0.0
        t0 = time.perf_counter()
        self.r.score(self.seqs)
        wall = time.perf_counter() - t0
        inside = self.lm.ort_seconds - ort0
        return {"seconds": wall, "tok_s": SEQUENCES * TOKENS / wall,
                "inside_ort": inside / wall, "log_softmax": self.ls_seconds / wall,
                "rest": (wall - inside - self.ls_seconds) / wall}

    def best(self, min_total: float = 1.0, max_calls: int = 5) -> dict:
        """The fastest of at least one call, more while they took under ``min_total`` s (as
        the bench's cell: ``best_of``)."""
        best, total, k = None, 0.0, 0
        while k < 1 or (total < min_total and k < max_calls):
            x = self.once()
            total, k = total + x["seconds"], k + 1
            if best is None or x["seconds"] < best["seconds"]:
                best = x
        return {**best, "calls": k}


class _Profiled:
    """Score passes (the engine's ``score_steps``, the engine's chunk cap) on a session of the
    same artifact with onnxruntime's profiler on."""

    def __init__(self, art: Path, threads: int, cap: int, seqs: list, tmp: str):
        from kvserve.artifact.loader import load_lm
        from kvserve.artifact.providers import session_options

        so = session_options(threads)
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / art.parent.name)
        self.lm = load_lm(art, provider="cpu", threads=threads, attention=False, options=so)
        self.cap, self.seqs = cap, seqs
        self.calls = 0  # graph runs per pass
        self.once()  # warm-up (its runs are left out)
        self.skip = self.calls

    def once(self) -> None:
        from kvserve.server.domain import ScoreRequest
        from kvserve.server.scoring import score_steps

        steps = score_steps(self.lm, ScoreRequest(sequences=self.seqs), self.cap)
        self.calls = sum(1 for _ in steps)  # a yield after each graph run

    def passes(self, warmup: bool = False) -> list[dict]:
        """op_shares of each pass after the warm-up (or of the warm-up's); ends the profile."""
        events = json.loads(Path(self.lm.session(False).end_profiling()).read_text())
        win = run_windows(events)[0 if warmup else self.skip:]
        n = self.calls
        return [op_shares(events, win[i][0], win[i + n - 1][1] + 1)
                for i in range(0, len(win) - n + 1, n)]


def _flops(art: Path) -> tuple[float, dict]:
    from .roofline import decode_graph, decode_weight_bytes, score_flops_per_token

    dims = json.loads((art / "manifest.json").read_text())["model"]
    d = dims["n_heads"] * dims["head_dim"]
    params = decode_weight_bytes(decode_graph(art))["matmul_params"]
    model = {"n_layers": dims["n_layers"], "d_model": d, "vocab_size": dims["vocab_size"],
             "matmul_params": params}
    return score_flops_per_token(params, dims["n_layers"], d, TOKENS), model


def measure(art: Path, rounds: int, threads: int) -> dict:
    """``rounds`` rounds of profiled Score / peak / timed Score, one after the other."""
    flops, model = _flops(art)
    d, V = model["d_model"], model["vocab_size"]
    rows = SEQUENCES * TOKENS  # the bench's roofline shapes (bench/main.py's _roofline)
    bench_shapes = [(rows, d, 4 * d), (rows, d, V)]
    timed = _Timed(art, threads)
    try:
        cap = timed.r.engine.chunk_tokens
        out = _rounds(art, rounds, threads, timed, cap, bench_shapes, flops)
    finally:
        timed.r.close()
    return summarise(out, flops, model, cap)


def _rounds(art: Path, rounds: int, threads: int, timed: _Timed, cap: int,
            bench_shapes: list[tuple[int, int, int]], flops: float) -> list[dict]:
    from .roofline import peak_in_subprocess

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        # every MatMul shape of the Score calls, from a first profiled session's warm-up pass
        first = _Profiled(art, threads, cap, timed.seqs, tmp)
        call_shapes = [tuple(map(int, k.split("x")))
                       for k in first.passes(warmup=True)[0]["matmul_by_shape"]]
        del first
        prof = _Profiled(art, threads, cap, timed.seqs, tmp)
        for _ in range(rounds):
            for _ in range(PASSES):
                prof.once()
            peak = peak_in_subprocess(bench_shapes + call_shapes, threads, 5)
            by = peak["gflops_by_shape"]
            out.append({"load": loadavg(), "peak_by_shape": by,
                        "roofline_gflops": max(by[f"{m}x{k}x{n}"] for m, k, n in bench_shapes),
                        "gflops_at_call_shapes": max(by[f"{m}x{k}x{n}"]
                                                     for m, k, n in call_shapes),
                        "timed": timed.best()})
        passes = prof.passes()
        # each round's fastest profiled pass (a neighbour's burst slows a pass, never speeds it)
        fastest = [min(passes[i:i + PASSES], key=lambda p: p["run_us"])
                   for i in range(0, len(passes), PASSES)]
        for r, p in zip(out, fastest):
            r["profile"] = p
            r.update(roofline(r["timed"]["tok_s"], r["roofline_gflops"], flops))
            r["explained"] = explained(r["timed"], p, r["roofline_gflops"], flops,
                                       SEQUENCES * TOKENS)
            r["matmul_vs_same_shapes"] = same_shape_efficiency(p, r["peak_by_shape"])
    return out


def summarise(rounds: list[dict], flops: float, model: dict, cap: int) -> dict:
    """The run's figures, each the best the run saw (a neighbour's burst only ever slows a
    measurement: on 2 shared cores it takes one of the two threads, halving a MatMul's
    GFLOP/s or a Score call for as long as it lasts): the fastest timed Score call and its
    split, the fastest profiled pass, the highest MatMul GFLOP/s of each shape; the fraction
    against the bench's roofline shapes and against every shape measured. Each round's own
    ratio is kept beside them (``round_fractions``), with the rounds themselves."""
    t = max((r["timed"] for r in rounds), key=lambda x: x["tok_s"])
    p = min((r["profile"] for r in rounds), key=lambda x: x["run_us"])
    by = {k: max(r["peak_by_shape"][k] for r in rounds) for k in rounds[0]["peak_by_shape"]}
    gflops = max(r["roofline_gflops"] for r in rounds)
    best = {"tok_s": t["tok_s"], "roofline_gflops": gflops, **roofline(t["tok_s"], gflops, flops),
            "fraction_all_shapes": roofline(t["tok_s"], max(by.values()), flops)["fraction"],
            "gflops_all_shapes": max(by.values()),
            "split": {k: t[k] for k in ("inside_ort", "log_softmax", "rest")},
            "op_shares": {op: o["share"] for op, o in p["ops"].items()},
            "matmul_gflops": p["matmul_gflops"],
            "matmul_vs_same_shapes": same_shape_efficiency(p, by),
            "explained": explained(t, p, gflops, flops, SEQUENCES * TOKENS),
            "attention": attention_gflops(p, model["n_layers"], model["d_model"], TOKENS,
                                          SEQUENCES * TOKENS),
            "round_fractions": [r["fraction"] for r in rounds],
            "load": [r["load"] for r in rounds]}
    return {"model": model, "flops_per_token": flops, "sequences": SEQUENCES, "tokens": TOKENS,
            "chunk_tokens": cap, "peak_by_shape": by, "best": best, "rounds": rounds}


# --- report ------------------------------------------------------------------------------------
def _attention_line(res: dict) -> str:
    """Attention's GFLOP/s per size, each kernel described once."""
    found = [(size, a) for size, r in res["sizes"].items() for a in [r["best"]["attention"]]
             if a]
    kernels = list(dict.fromkeys(a.get("op", "GroupQueryAttention") for _, a in found))
    return "Attention (" + "; ".join(f"{ATTENTION_KERNELS.get(k, k)}" for k in kernels) + \
        ") runs at " + "; ".join(
            f"{size}: {a['causal_gflops']:.0f} GFLOP/s on the causal FLOPs the roofline counts"
            + (f" ({a['computed_gflops']:.0f} on the products it computes)"
               if a["computed_gflops"] > a["causal_gflops"] * 1.01 else "")
            + (f" ({a.get('op', 'GroupQueryAttention')})" if len(kernels) > 1 else "")
            for size, a in found) + "."


def render(res: dict) -> str:
    m = res["meta"]
    lines = [f"Generated by `python -m kvserve.bench.score_profile --update-docs` ({m['date']}, "
             f"{m['machine']}, {m['threads']} threads; load average {m['load_before']:.1f} "
             f"before, {m['load_after']:.1f} after; {m['rounds']} rounds): the bench's Score "
             f"cell ({SEQUENCES} sequences × {TOKENS} tokens) on the engine; each figure the "
             "best of the run. Roofline: onnxruntime's fp32 MatMul GFLOP/s at the bench's "
             "roofline shapes (in brackets: at the best of every shape measured, the Score "
             "calls' own included) × FLOPs per scored token.", "",
             "| model | tok/s | roofline tok/s | fraction | in onnxruntime | log-softmax | "
             "rest (Python) | MatMul | attention | other ops | MatMul ÷ roofline GFLOP/s "
             "(timed; profiled) | MatMul vs alone |", "|" + "---|" * 12]
    for size, r in res["sizes"].items():
        x, e = r["best"], r["best"]["explained"]
        mm = x["op_shares"].get("MatMul", 0.0)
        gqa = sum(x["op_shares"].get(op, 0.0) for op in ATTENTION_OPS)
        alone = x["matmul_vs_same_shapes"]
        lines.append(
            f"| {size} | {x['tok_s']:,.0f} | {x['roofline_tok_s']:,.0f} | {x['fraction']:.2f} "
            f"({x['fraction_all_shapes']:.2f}) | {x['split']['inside_ort']:.1%} | "
            f"{x['split']['log_softmax']:.1%} | {x['split']['rest']:.1%} | {mm:.1%} | "
            f"{gqa:.1%} | {1 - mm - gqa:.1%} | {e['matmul_efficiency']:.2f}; "
            f"{e['matmul_efficiency_profiled']:.2f} | "
            f"{'-' if alone is None else f'{alone:.2f}'} |")
    each = res["sizes"].items()
    lines += ["", "Other ops (share of the graph's node time): " + "; ".join(
        f"{size}: " + ", ".join(f"{op} {v:.1%}" for op, v in r["best"]["op_shares"].items()
                                if op not in ("MatMul", *ATTENTION_OPS) and v >= 0.001)
        for size, r in each) + ".", "",
        "Fraction = in onnxruntime × MatMul share of the graph × MatMul ÷ roofline GFLOP/s "
        "(timed) × (roofline FLOPs ÷ MatMul FLOPs): " + "; ".join(
            f"{size}: {e['inside_ort']:.2f} × {e['matmul_share']:.2f} × "
            f"{e['matmul_efficiency']:.2f} × {e['flops_over_matmul_flops']:.2f} = "
            f"{e['product']:.2f}" for size, r in each for e in [r["best"]["explained"]]) + ".",
        "", _attention_line(res), "",
        "With every MatMul node at the roofline's GFLOP/s and the rest as measured (attention, "
        "the other ops, the log-softmax, Python), Score would reach " + "; ".join(
            f"{size}: {r['best']['explained']['ceiling_matmul_at_roofline']:.2f}"
            for size, r in each) + " of the roofline. Each round's own fraction (its Score "
        "call over its roofline): " + "; ".join(
            f"{size}: " + ", ".join(f"{f:.2f}" for f in r["best"]["round_fractions"])
            for size, r in each) + "."]
    return "\n".join(line if line.startswith("|") else textwrap.fill(line, 100)
                     for line in lines)


def main(argv: list[str] | None = None) -> int:
    from .build import build
    from .report import update_doc

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="6m,100m", help="comma-separated: 6m, 100m")
    ap.add_argument("--cache", default=".bench", help="built bench models (bench/build.py)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--update-docs", action="store_true",
                    help="write bench/results/score-profile.json and the docs/speed.md block")
    ap.add_argument("--render-only", action="store_true",
                    help="the docs block from bench/results/score-profile.json, no measurement")
    args = ap.parse_args(argv)
    if args.render_only or args.update_docs:
        committed_results("--render-only" if args.render_only else "--update-docs")
    if args.render_only:
        update_doc(DOC, render(json.loads(OUT.read_text())), START, END)
        return 0
    cache = Path(args.cache)
    res = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": machine(), "versions": versions(), "rounds": args.rounds,
                    "threads": args.threads, "load_before": loadavg()}, "sizes": {}}
    for key in args.sizes.split(","):
        size = SIZES.get(key.strip(), key.strip())
        art = cache / "models" / size / "fp32"  # as built, whatever code built it
        if not (art / "manifest.json").is_file():
            art = build(size, cache, genai=False).fp32
        res["sizes"][size] = measure(art, args.rounds, args.threads)
        print(size, json.dumps(res["sizes"][size]["best"]))
    res["meta"]["load_after"] = loadavg()
    dest = OUT if args.update_docs else cache / "score-profile.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(res, indent=1) + "\n")
    print(render(res))
    if args.update_docs:
        update_doc(DOC, render(res), START, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

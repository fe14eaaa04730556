"""``kvserve bench``: build (or reuse) the benchmark models, load every runner in its own process
and let them take turns cell by cell (``bench/turns.py``), write ``<size>.json`` and
``tables.md`` into a results directory, and print the tables.

  kvserve bench                     full run (6M, 100M, small) into a new
                                    .bench/results/<UTC time>/ (nothing committed is touched)
  kvserve bench --quick             6M only, fewer tokens: .bench/results/<UTC time>-quick/
  kvserve bench --results DIR       into DIR
  kvserve bench --update-committed  into bench/results/, and the generated block of
                                    docs/benchmarks.md (between ``<!-- bench:start -->`` and
                                    ``<!-- bench:end -->``)
  kvserve bench --render-only [--update-committed]   tables from existing results
  kvserve bench --profile           profile the decode loop -> profile.md in the results dir
  kvserve bench --provider cuda     the CUDA check (bench/cuda_check.py) -> cuda.json
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import sys
import time
from pathlib import Path

from .common import (BENCH_DOC, CACHE, RESULTS, committed_results, loadavg, machine,
                     server_speedups, versions)
from .merge import merge_runners, merge_speed
from .turns import SETTLE

log = logging.getLogger(__name__)

ROUNDS = 3  # default --repeats: turns each runner takes at each cell
TRAINED_ROUNDS = 5  # ... on the trained size: its one cell (speculation, ~15 s a round) holds
# #27's closest targets, and its per-round ratios spread widely (1.98 / 1.09 / 1.03 in a run of
# 2026-12-02): the median of 5 is steadier than the median of 3


def default_rounds(size: str) -> int:
    return TRAINED_ROUNDS if size == "trained" else ROUNDS


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="6M model only, fewer tokens (development)")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated: bench-6m,bench-100m,small,trained (default: "
                             "all; --quick: bench-6m; trained: the default trained model, "
                             "speculation on held-out code, trained once into --cache)")
    parser.add_argument("--runners", default=None,
                        help="comma-separated subset: engine,engine_on,loop,engine_int8,"
                             "engine_int4,genai,torch,hf,grpc,llamacpp,llamacpp_q8,llamacpp_q4")
    parser.add_argument("--results", default=None, metavar="DIR",
                        help="where the results JSON and tables.md go (default: a new "
                             "directory .bench/results/<UTC time>[-quick] under --cache); with "
                             "--render-only: the results to render (default bench/results)")
    parser.add_argument("--update-committed", action="store_true",
                        help="write the committed results (bench/results) and the "
                             "generated block of docs/benchmarks.md; without it neither is "
                             "touched")
    parser.add_argument("--cache", default=str(CACHE),
                        help="where built models live, reused by later runs (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads, every runner")
    parser.add_argument("--repeats", type=_at_least_one, default=None,
                        help="rounds: how many turns each runner takes at each cell, keeping "
                             f"its best (default {ROUNDS}; {TRAINED_ROUNDS} on the trained "
                             f"size); the runners stay loaded side by "
                             "side and take turns cell by cell, in alternating order, so the "
                             "ones a cell compares are measured seconds apart (this machine's "
                             "speed drifts within minutes)")
    parser.add_argument("--settle", type=float, default=SETTLE, metavar="SECONDS",
                        help="pause before each turn, so that the previous runner's "
                             "onnxruntime threads have stopped spinning (default "
                             f"{SETTLE}; 0: none)")
    parser.add_argument("--render-only", action="store_true",
                        help="no measurement: print the tables of existing results (with "
                             "--update-committed: rebuild bench/results/tables.md and "
                             "docs/benchmarks.md's block from bench/results/*.json)")
    parser.add_argument("--no-docs", "--no-readme", dest="no_docs", action="store_true",
                        help="with --update-committed: results only, docs/benchmarks.md "
                             "untouched")
    parser.add_argument("--wait-load", type=float, default=0.0, metavar="CORES",
                        help="before each size's runners, wait (at most --wait-max seconds) until "
                             "other processes use less than CORES cores (0 = do not wait); "
                             "the 1-minute load average is recorded either way")
    parser.add_argument("--wait-max", type=float, default=900.0, metavar="SECONDS",
                        help="the longest --wait-load waits for a quiet machine before "
                             "measuring anyway (default: %(default)s)")
    parser.add_argument("--speed-only", action="store_true",
                        help="only the prefix cache's and speculation's cells (shared prefix, "
                             "chat replay, speculation); merged into the size's results JSON "
                             "when the results directory has one")
    parser.add_argument("--llamacpp-only", action="store_true",
                        help="only llama.cpp (llama-cpp-python) against the engine at the same "
                             "cells and precisions; written as <size>+llamacpp.json")
    parser.add_argument("--trained-ckpt", default=None, metavar="DIR",
                        help="the trained size: this checkpoint of a default `kvserve train` "
                             "run (e.g. an unfinished run's last save) instead of training one "
                             "(the results label says its step)")
    parser.add_argument("--profile", action="store_true",
                        help="only profile the decode loop (writes profile.md)")
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: run the CUDA check instead (CUDA vs CPU logits and greedy "
                             "tokens, fp16 perplexity, speed vs transformers on CUDA) and write "
                             "cuda.json to the results directory")


# --- the plan ----------------------------------------------------------------------------------
def speed_plan(size: str, quick: bool, rep: int) -> dict[str, dict]:
    """The prefix cache's and speculation's cells (``bench/speed_cells.py``): the engine with
    both off (``engine``, merged into its entry), with the server's defaults (``engine_on``),
    onnxruntime-genai re-prefilling (``genai``). ``trained``: speculation only, on the default
    trained model continuing held-out code."""
    chat = dict(turns=8, first=256, user=32, reply=32)
    spec = dict(batches=[1, 8], n=128, files=16)
    prefix = [[1000, 16]]
    if quick:
        chat, spec = dict(chat, turns=4), dict(spec, files=8, n=64)
    elif size == "bench-100m":
        spec = dict(spec, files=8, n=64)  # ~20 tok/s per stream here: fewer tokens
    if size == "trained":
        cells = {"spec": spec}
    elif size in ("bench-6m", "bench-100m"):
        cells = {"prefix": prefix, "chat": chat, "spec": spec}
    else:
        return {}
    on = {"runner": "engine", **server_speedups(), **cells, "repeats": rep, "prompt_len": 32}
    out = {"engine": dict(cells), "engine_on": on, "genai": dict(cells)}
    if llamacpp_installed() and "spec" in cells:
        out["llamacpp"] = {"spec": spec}
    return out


def llamacpp_only_plan(size: str, quick: bool, rep: int) -> dict[str, dict]:
    """``--llamacpp-only``: llama.cpp's cells and kvserve's engine at the same cells and
    precisions (fp32, and on 100M int8 / int4), nothing else."""
    ll = llamacpp_plan(size, quick, rep)
    if not ll:
        return {}
    cell = {k: v for k, v in ll["llamacpp"].items() if k != "quant"}
    out = {"engine": dict(cell), **ll}
    if "llamacpp_q8" in ll:
        out["engine_int8"] = dict(cell, sample_tokens=False)
    return out


def llamacpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llamacpp_plan(size: str, quick: bool, rep: int) -> dict[str, dict]:
    """llama.cpp's decode cells, batch 1 and 8 (its sequences in one context), on the same
    weights as kvserve's fp32 (f32 GGUF) and, on 100M, int8 / int4 (q8_0 / q4_0); beside
    them, at each precision, the floor of kvserve's kernels (``matmuls``: the artifact's
    matrix products alone, ``bench/runner_floor.py``)."""
    if not llamacpp_installed() or size not in ("bench-6m", "bench-100m"):
        return {}
    n = 64 if quick else 128
    cell = dict(prompt_len=32, repeats=rep, batches=[1, 8], decode=[[1, n], [8, n]],
                sample_tokens=True)
    out = {"llamacpp": dict(cell, quant="f32"), "matmuls": dict(cell, sample_tokens=False)}
    if size == "bench-100m" and not quick:
        out["llamacpp_q8"] = dict(cell, quant="q8_0", sample_tokens=False)
        out["llamacpp_q4"] = dict(cell, quant="q4_0", sample_tokens=False)
        out["engine_int4"] = dict(cell, sample_tokens=False)
        out["matmuls_int8"] = dict(cell, sample_tokens=False)
        out["matmuls_int4"] = dict(cell, sample_tokens=False)
    return out


def plan(size: str, quick: bool, repeats: int | None) -> dict[str, dict]:
    """runner -> what it measures (``repeats``: in how many rounds of turns it takes part).
    Expensive peers run fewer cells on the 100M model. The gRPC runner's batch of B is B
    concurrent streams (``kvserve serve``: the prefix cache and speculation at their
    defaults)."""
    rep = repeats or default_rounds(size)
    out = {**_base_plan(size, quick, rep), **llamacpp_plan(size, quick, rep)}
    for name, cells in speed_plan(size, quick, rep).items():
        out[name] = {**out.get(name, {"repeats": rep, "prompt_len": 32}), **cells}
    return out


def _base_plan(size: str, quick: bool, rep: int) -> dict[str, dict]:
    if size == "trained":
        return {}
    if quick:
        base = dict(prompt_len=32, repeats=rep, batches=[1, 8],
                    decode=[[1, 128], [8, 128], [16, 128]], ttft=[32, 512], itl=128,
                    steps=[16, 256], step_count=8, sample_tokens=True)
        slow = {**base, "decode": [[1, 32], [8, 32]], "batches": [1, 8], "ttft": [32],
                "steps": [], "itl": 0}
        return {"engine": {**base, "batches": [1, 8, 16], "score": [4, 64]},
                "loop": dict(base),
                "genai": dict(base),
                "torch": {**slow, "score": [4, 64]},
                "hf": {**slow, "score": [4, 64]},
                "grpc": dict(prompt_len=32, repeats=rep, decode=[[1, 128], [8, 128]])}
    full = [[b, n] for b in (1, 8, 16) for n in (128, 512)]
    base = dict(prompt_len=32, repeats=rep, batches=[1, 8, 16], decode=full, ttft=[32, 512],
                itl=128, steps=[16, 256, 1000], step_count=16, step_batches=[16],
                sample_tokens=True)
    if size == "bench-6m":
        slow = {**base, "decode": [[1, 128], [1, 512], [8, 128], [8, 512], [16, 128]],
                "steps": [], "step_batches": [], "itl": 0}
        return {"engine": {**base, "score": [8, 256]}, "loop": dict(base),
                "genai": dict(base), "torch": {**slow, "score": [8, 256]},
                "hf": {**slow, "score": [8, 256]},
                "grpc": dict(prompt_len=32, repeats=rep, decode=[[1, 128], [8, 128]])}
    if size == "bench-100m":
        slow = {**base, "decode": [[1, 128], [8, 128]], "batches": [1, 8], "steps": [],
                "step_batches": [], "itl": 0, "ttft": [32], "repeats": 1}
        return {"engine": {**base, "score": [8, 256]}, "loop": dict(base),
                "engine_int8": {**base, "decode": [[1, 128], [1, 512], [8, 128]],
                                "batches": [1, 8], "steps": [], "step_batches": [],
                                "itl": 0},
                "genai": dict(base), "torch": {**slow, "score": [4, 128]},
                "hf": {**slow, "score": [8, 256]},
                "grpc": dict(prompt_len=32, repeats=rep, decode=[[1, 128], [8, 128]])}
    # small preset: our engine against the reference runtime only
    small = {**base, "decode": [[1, 128], [8, 128], [16, 128]], "ttft": [32], "steps": [],
             "step_batches": [], "itl": 0}
    return {"engine": dict(small), "loop": dict(small), "genai": dict(small)}


def others_cpu(window: float = 2.0) -> float:
    """CPU (in cores) used by processes other than this one over ``window`` seconds: what the
    1-minute load average cannot tell apart from our own previous runner."""
    import psutil

    me = os.getpid()
    procs = []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            p.cpu_percent(None)
            procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    time.sleep(window)
    total = 0.0
    for p in procs:
        try:
            total += p.cpu_percent(None)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total / 100.0


def wait_for_quiet(threshold: float, max_seconds: float) -> float:
    """Wait (at most ``max_seconds``) until other processes use under ``threshold`` cores for
    two windows in a row; returns the last figure (recorded with each runner)."""
    if threshold <= 0:
        return float("nan")
    end = time.monotonic() + max_seconds
    calm = 0
    while True:
        busy = others_cpu()
        calm = calm + 1 if busy < threshold else 0
        if calm >= 2:
            return busy
        if time.monotonic() >= end:
            log.warning("other processes still use %.2f cores after waiting %.0fs; measuring "
                        "anyway", busy, max_seconds)
            return busy
        if calm == 0:
            log.info("waiting for a quiet machine: others use %.2f cores", busy)
            time.sleep(5)


def size_plan(name: str, args) -> dict[str, dict]:
    """The plan of one size after ``--runners`` and ``--speed-only``."""
    rep = args.repeats or default_rounds(name)
    if args.speed_only:
        pl = {k: {"repeats": rep, "prompt_len": 32, **v}
              for k, v in speed_plan(name, args.quick, rep).items()}
    elif args.llamacpp_only:
        pl = llamacpp_only_plan(name, args.quick, rep)
    else:
        pl = plan(name, args.quick, args.repeats)
    want = set(args.runners.split(",")) if args.runners else None
    return {k: v for k, v in pl.items() if k in want} if want else pl


def build_size(name: str, pl: dict, args):
    from . import build as B

    cache = Path(args.cache)
    if name == "trained":
        from .trained import build_trained

        return build_trained(cache, genai="genai" in pl, threads=args.threads,
                             ckpt=Path(args.trained_ckpt) if args.trained_ckpt else None)
    return B.build(name, cache, genai="genai" in pl, int8=any(k.endswith("_int8") for k in pl),
                   int4=any(k.endswith("_int4") for k in pl), threads=args.threads)


def gguf_paths(built, pl: dict, cache: Path) -> dict[str, str] | None:
    """The llama.cpp runners' GGUF files (made once per size; ``bench/gguf_convert.py``)."""
    kinds = {v.get("quant", "f32") for k, v in pl.items() if k.startswith("llamacpp")}
    if not kinds:
        return None
    from .gguf_convert import gguf_files

    files = gguf_files(built.hf, built.root / "gguf", cache, sorted(kinds | {"f32"}))
    return {k: str(v) for k, v in files.items()}


def code_prompts(built, pl: dict) -> tuple[list[list[int]] | None, list[str]]:
    """The speculation cell's prompts: held-out stdlib files in the model's tokenizer."""
    files = max((v["spec"]["files"] for v in pl.values() if v.get("spec")), default=0)
    if not files:
        return None, []
    from .trained import code_prompts as prompts_of, held_out_files

    return prompts_of(built.fp32 / "tokenizer.json", held_out_files(), n=files)


def run_size(name: str, args, results_dir: Path) -> dict:
    from . import build as B
    from .turns import run_turns

    cache = Path(args.cache)
    pl = size_plan(name, args)
    built = build_size(name, pl, args)
    load_before = loadavg()
    out = {"size": name, "label": built.size.label, "runners": {},
           "meta": {"quick": args.quick, "date": _dt.datetime.now().isoformat(timespec="seconds"),
                    "machine": machine(), "versions": versions(), "seed": B.SEED,
                    "threads": args.threads, "load_before": load_before,
                    "build_seconds": built.build_seconds}}
    prompts, files = code_prompts(built, pl)
    if files:
        out["meta"]["code_files"] = files
        out["meta"]["code_prompt_tokens"] = len(prompts[0])
    paths = dict(artifact=str(built.fp32), ckpt=str(built.ckpt), hf=str(built.hf),
                 genai=str(built.genai) if built.genai else None,
                 int8_artifact=str(built.int8) if built.int8 else None,
                 vocab=built.size.vocab, threads=args.threads,
                 int4_artifact=str(built.int4) if built.int4 else None,
                 workdir=str(cache / "tmp"), code_prompts=prompts,
                 gguf=gguf_paths(built, pl, cache))
    rounds = args.repeats or default_rounds(name)
    out["meta"]["rounds"] = rounds
    busy = wait_for_quiet(args.wait_load, args.wait_max)
    log.info("%s: %s taking turns, %d rounds (load %.2f)", name, ", ".join(pl), rounds,
             load_before)
    t0 = time.perf_counter()
    out["meta"]["settle_seconds"] = settle = max(0.0, args.settle)
    out["runners"] = run_turns(pl, paths, rounds, cache / "tmp", settle)
    out["meta"]["others_cores_before"] = busy
    out["meta"]["measure_seconds"] = round(time.perf_counter() - t0, 1)
    if not (args.speed_only or args.llamacpp_only) and name != "trained":
        wait_for_quiet(args.wait_load, min(args.wait_max, 30))
        out["roofline"] = _roofline(built, pl, args, out)
    out["meta"]["load_after"] = loadavg()
    results_dir.mkdir(parents=True, exist_ok=True)
    if args.llamacpp_only:  # its own results: kvserve vs llama.cpp, measured together
        out["size"], out["label"] = f"{name}+llamacpp", f"{out['label']}: kvserve vs llama.cpp"
    path = results_dir / f"{out['size']}.json"
    if args.speed_only and path.is_file():  # the new cells into the size's existing results
        out = merge_speed(json.loads(path.read_text()), out)
    elif args.runners and path.is_file() and not args.llamacpp_only:
        out = merge_runners(json.loads(path.read_text()), out)
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return out


def _roofline(built, pl: dict, args, out: dict) -> dict:
    """Bytes per decode step vs read bandwidth, and Score's compute roofline: measured per
    size, right after its runners; the roofline uses the best bandwidth of the run (a busy
    neighbour only ever lowers it)."""
    from .roofline import (bandwidth_in_subprocess, decode_graph, decode_weight_bytes,
                           peak_in_subprocess)

    bw = bandwidth_in_subprocess(128 if args.quick else 512, 3 if args.quick else 7,
                                 args.threads)
    global _BEST_BW
    if _BEST_BW is None or bw["gbps"] > _BEST_BW["gbps"]:
        _BEST_BW = bw
    bw = {**_BEST_BW, "this_size_gbps": bw["gbps"]}
    rf = {"bandwidth": bw, "fp32": decode_weight_bytes(decode_graph(built.fp32))}
    dims = json.loads((built.fp32 / "manifest.json").read_text())["model"]
    d_model = dims["n_heads"] * dims["head_dim"]
    rf["model"] = {"n_layers": dims["n_layers"], "d_model": d_model,
                   "vocab_size": dims["vocab_size"],
                   # an fp32 cache row: K and V of every layer
                   "kv_bytes_per_token": 2 * dims["n_layers"] * dims["n_kv_heads"]
                   * dims["head_dim"] * 4}
    score = (pl.get("engine") or {}).get("score")
    if score:  # the MatMul shapes of the Score call: the FFN's and the lm_head's
        rows = score[0] * score[1]
        rf["compute"] = peak_in_subprocess([(rows, d_model, 4 * d_model),
                                            (rows, d_model, dims["vocab_size"])],
                                           args.threads, 3 if args.quick else 5)
    steady = _steady(out["runners"].get("loop"))
    if steady:
        rf["fp32"]["steady_tok_s"] = steady
    if built.int8 is not None and "engine_int8" in pl:
        rf["int8"] = decode_weight_bytes(decode_graph(built.int8))
        man = json.loads((built.int8 / "manifest.json").read_text())
        out["int8_perplexity"] = {"fp32": _get_ppl(man, "fp32"), "int8": _get_ppl(man, "int8"),
                                  "relative_change": man.get("perplexity", {})
                                  .get("relative_change"),
                                  "eval_tokens": man.get("perplexity", {}).get("eval_tokens")}
    return rf


_BEST_BW: dict | None = None


def _get_ppl(man: dict, key: str):
    return man.get("perplexity", {}).get(key)


def _steady(loop: dict | None) -> float | None:
    """Batch-1 tok/s from the raw loop's decode step time at position 256."""
    ms = ((loop or {}).get("step_ms") or {}).get("256")
    return 1000.0 / ms if ms else None


def choose_results_dir(args: argparse.Namespace) -> Path:
    """Where this invocation writes (or, with --render-only, reads) results. The committed
    bench/results only with --update-committed (or when named with --results)."""
    if args.update_committed:
        if args.results and Path(args.results).resolve() != RESULTS.resolve():
            raise SystemExit("kvserve bench: --update-committed writes bench/results; drop "
                             "--results (or drop --update-committed)")
        return committed_results("--update-committed")
    if args.results:
        return Path(args.results)
    if args.render_only:
        return committed_results("--render-only without --results")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(args.cache) / "results" / (stamp + ("-quick" if args.quick else ""))


def render_all(results_dir: Path, doc: Path | None, write_table: bool = True) -> str:
    from .report import load_results, render, update_doc

    results = load_results(results_dir)
    if not results:
        raise SystemExit(f"kvserve bench: no results in {results_dir}")
    section = render(results)
    if write_table:
        (results_dir / "tables.md").write_text(section + "\n")
    if doc is not None:
        update_doc(doc, section)
    return section


def main(args: argparse.Namespace) -> int:
    out = choose_results_dir(args)
    committed = out.resolve() == RESULTS.resolve()
    doc = BENCH_DOC if args.update_committed and not args.no_docs else None
    if args.render_only:  # committed files are rewritten only when asked
        print(render_all(out, doc, write_table=args.update_committed or not committed))
        return 0
    from kvserve.export.logs import quiet_exporter_logs

    quiet_exporter_logs()  # (artifacts are exported when missing: the quantizers narrate)
    log.info("results go to %s%s", out, "" if committed else
             " (the committed bench/results and docs/benchmarks.md are untouched; "
             "--update-committed writes them)")
    args.results = str(out)
    if args.profile:
        from .loop_profile import main as profile_main

        return profile_main(args)
    if args.provider == "cuda":
        from .cuda_check import run as cuda_check

        return cuda_check(args.sizes or "bench-6m", Path(args.cache), args.threads,
                          out / "cuda.json")
    sizes = args.sizes.split(",") if args.sizes else \
        (["bench-6m"] if args.quick else ["bench-6m", "bench-100m", "small", "trained"])
    t0 = time.perf_counter()
    log.info("load average before: %.2f", loadavg())
    if loadavg() >= 1.0 and not args.quick:
        log.warning("load average %.2f >= 1.0: timings will be noisy (the JSON records it)",
                    loadavg())
    for name in sizes:
        run_size(name, args, out)
    print(render_all(out, doc))
    print(f"results: {out}" + ("" if doc else "; docs/benchmarks.md untouched"))
    log.info("bench done in %.0fs; load average after: %.2f", time.perf_counter() - t0,
             loadavg())
    return 0


if __name__ == "__main__":
    from kvserve.cli import main as cli_main

    sys.exit(cli_main(["bench", *sys.argv[1:]]))

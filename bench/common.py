"""What the bench scripts share: where results go, what machine they ran on, and a process's
memory from /proc. Imported by the other bench modules; imports none of them (``fp32_sizes_main``
builds the models through ``bench.build`` when called)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# a source checkout (the tree itself, or an editable install of it) holds the committed
# results and docs beside bench/; an installed package has neither (REPO is then the package
# in site-packages, which nothing may write into)
CHECKOUT = (REPO / "pyproject.toml").is_file()
RESULTS = REPO / "bench" / "results"  # committed results: written only when asked for
# the generated block of this page holds the committed tables
BENCH_DOC = REPO / "docs" / "benchmarks.md"
# built models and scratch results (git-ignored in a checkout; else under the working directory)
CACHE = (REPO if CHECKOUT else Path.cwd()) / ".bench"


def committed_results(what: str) -> Path:
    """``RESULTS``, for ``what`` (the option that reads or writes them): a checkout's only."""
    if not CHECKOUT:
        raise SystemExit(f"kvserve bench: {what} reads and writes the committed results of a "
                         f"kvserve source checkout (bench/results, docs/benchmarks.md); this "
                         f"is an installed package: run it from a checkout, or give --results")
    return RESULTS


def add_results_options(ap, name: str) -> None:
    """A bench script's ``--cache`` / ``--out`` / ``--update-committed`` / ``--render-only``
    for its results ``name`` (a .json beside its rendered .md)."""
    ap.add_argument("--cache", default=str(CACHE))
    ap.add_argument("--out", default=None, help="results .json path (default: under --cache)")
    ap.add_argument("--update-committed", action="store_true",
                    help=f"write bench/results/{name} and its .md")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite the .md of the results (--out, else the committed ones) only")


def results_path(ap, args, name: str) -> Path:
    """Where the results go (``add_results_options``): the committed ones with
    ``--update-committed`` or a bare ``--render-only``, else ``--out`` or the cache's."""
    if args.out and args.update_committed:
        ap.error("--out and --update-committed exclude each other")
    if args.update_committed or (args.render_only and not args.out):
        return committed_results("--update-committed") / name
    return Path(args.out) if args.out else Path(args.cache) / name


def parse_results_args(ap, argv, name: str, render):
    """A bench script's options with ``add_results_options``' for its results ``name``, parsed:
    (args, where the results go), or None where ``--render-only`` asked for the .md alone
    (written here)."""
    add_results_options(ap, name)
    args = ap.parse_args(argv)
    out = results_path(ap, args, name)
    if args.render_only:
        write_results(out, None, render)
        return None
    return args, out


def write_results(out: Path, data: dict | None, render) -> None:
    """``data`` as ``out`` (.json) and its ``render`` as the .md beside it; ``data`` None: the
    .md re-rendered from the .json there (``--render-only``)."""
    import json

    if data is None:
        out.with_suffix(".md").write_text(render(json.loads(out.read_text())))
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(data))
    print(render(data))
    print(f"written {out} and {out.with_suffix('.md').name}")


def loadavg() -> float:
    return os.getloadavg()[0]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()}"


def run_header(**fields) -> dict:
    """A bench script's results header: ``fields`` (its options) and where and when it ran
    (the CPU, onnxruntime's and Python's versions, the UTC minute)."""
    import datetime as dt
    import importlib.metadata as md

    return {**fields, "cpu": cpu_model(), "onnxruntime": md.version("onnxruntime"),
            "python": platform.python_version(),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def server_speedups() -> dict:
    """``kvserve serve``'s defaults for the prefix cache and speculation (``EngineRunner``'s
    keywords; ``engine_on`` in the plan)."""
    from kvserve.server.config import ServerConfig

    c = ServerConfig()
    return {"prefix_cache_mb": c.prefix_cache_mb, "speculative_tokens": c.speculative_tokens}


def fp32_sizes_main(doc: str, argv, name: str, render, measure) -> int:
    """The ``main`` of a script measuring ``measure(artifact, rounds, threads)`` (its results'
    entry for a size) on each bench size's fp32 artifact: ``--sizes``, ``--rounds``,
    ``--threads`` and the results options (``parse_results_args``) into ``name``."""
    import argparse

    from .build import build

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["bench-6m", "bench-100m"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    parsed = parse_results_args(ap, argv, name, render)
    if parsed is None:
        return 0
    args, out = parsed
    data = run_header(rounds=args.rounds, threads=args.threads, sizes={})
    for size in args.sizes:
        art = build(size, Path(args.cache), genai=False, int8=False).fp32
        data["sizes"][size] = measure(art, args.rounds, args.threads)
    write_results(out, data, render)
    return 0


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for p in ("onnxruntime", "onnxruntime-genai", "torch", "transformers", "numpy"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    return out


def proc_memory(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM (peak) and RssAnon (its anonymous part: not file-backed) of a process, in
    bytes, from ``/proc/PID/status`` (empty when unreadable). VmHWM, not ``ru_maxrss``: Linux
    carries that across fork+exec, so a child would report its parent's peak."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def memory_mb(key: str, pid: int | str = "self") -> float:
    """``VmRSS``, ``VmHWM`` or ``RssAnon`` of a process in MiB (NaN when unreadable)."""
    b = proc_memory(pid).get(key)
    return float("nan") if b is None else b / 2**20

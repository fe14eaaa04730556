"""Runners taking turns: every runner of a size is loaded once, each in its own process, and
they stay alive side by side while the orchestrator walks the cells (a decode batch × length,
a TTFT prompt, a step position, Score) and asks each runner in turn for one measurement of the
cell. After the last cell the walk starts again (``rounds``); each cell keeps each runner's
best turn, and its turns by round, which the report pairs: a target's ratio is the median over
rounds of the two runners' turns in the same round.

Why: this machine's speed drifts by tens of percent within minutes. Runners measured one after
another (the previous design: each runner's whole plan in a fresh process, then the next
runner's) took that drift into their ratios: two back-to-back runs once gave the engine 1.01×
and 0.65× onnxruntime-genai on the same cell. Turns put the runners a cell compares seconds
apart, and the runner order alternates between cells and rounds, so neither side always
measures first.

Before each turn the orchestrator waits ``SETTLE`` seconds: the runner that just finished
leaves onnxruntime's worker threads spinning for a while (they spin between runs by default),
and on 2 cores they slow the next runner's start. A short turn pays it whole: on the 6M size
the engine's first chat turn (a 256-token prefill) took 45-54 ms right after another runner's
turn and 19-24 ms after a 0.3 s pause (three runs each, 2026-12-02; onnxruntime-genai's 23-26
vs 19-23 ms, the shared-prefix cell's uncached requests unchanged within noise).
"""
from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import speed_cells
from .runners import REPLY

log = logging.getLogger(__name__)

TURN_TIMEOUT = 1800.0  # seconds one measurement may take before its runner is given up


class RunnerProcess:
    """``python -m kvserve.bench.runners SPEC`` kept alive: one JSON command per line in, one
    reply line out."""

    def __init__(self, name: str, spec: dict, log_path: Path):
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]),
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
        # llama.cpp's OpenMP threads keep their default wait policy (what its users get: they
        # spin a while at a barrier, then sleep). Forced to block (OMP_WAIT_POLICY=PASSIVE),
        # as the bench did before 2026-12-02, the default trained model at batch 1 on 2
        # threads ran at 219 tok/s against 2,465 by default (2,616 ACTIVE; batch 8: 1,094 vs
        # 3,350): each op's barrier became a sleep and a wake-up.
        env.pop("OMP_WAIT_POLICY", None)
        self.name, self.log_path = name, log_path
        self.err = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvserve.bench.runners",
                                      json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=env)
        self.error: str | None = None
        self.loaded = self._reply()  # the runner's load figures (or its error)

    def call(self, op: str, **args) -> dict | None:
        """One measurement; None when it failed (``error`` says why)."""
        if self.error is not None and self.proc.poll() is not None:
            return None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._fail("the runner process is gone")
            return None
        return self._reply()

    def _reply(self) -> dict | None:
        end = time.monotonic() + TURN_TIMEOUT
        while True:
            left = end - time.monotonic()
            ready = left > 0 and select.select([self.proc.stdout], [], [], left)[0]
            if not ready:
                self.proc.kill()
                self._fail(f"no answer in {TURN_TIMEOUT:.0f}s")
                return None
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                self._fail(f"the runner process exited ({self.proc.returncode})")
                return None
            if line.startswith(REPLY):
                msg = json.loads(line[len(REPLY):])
                if "error" in msg:
                    self._fail(msg["error"])
                    return None
                return msg["ok"]

    def _fail(self, why: str) -> None:
        tail = ""
        try:
            self.err.flush()
            tail = self.log_path.read_text()[-2000:]
        except OSError:
            pass
        log.error("%s: %s", self.name, why)
        if self.error is None:  # the first failure is the one worth reading
            self.error = why + (f"\n{tail}" if tail.strip() else "")

    def close(self) -> dict:
        out = (self.call("finish") or {}) if self.proc.poll() is None else {}
        try:
            self.proc.stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.err.close()
        return out


@dataclass
class Cell:
    """One thing measured: ``op`` with ``args``, by every runner in ``who``."""
    key: tuple
    op: str
    args: dict
    who: list[str] = field(default_factory=list)


def cells_of(plan: dict[str, dict], has: dict[str, dict],
             code_prompts: list[list[int]] | None = None) -> list[Cell]:
    """The cells of a size's plan, in order: decode, TTFT, inter-token latency, decode steps,
    Score, then the prefix cache's and speculation's cells (``bench/speed_cells.py``: shared
    prefix, chat replay, speculation on ``code_prompts``). ``has[runner]`` says which of
    steps / stream / score the runner offers."""
    found: dict[tuple, Cell] = {}

    def add(key, op, args, runner):
        found.setdefault(key, Cell(key, op, args)).who.append(runner)

    for r, spec in plan.items():
        if r not in has:  # failed to load
            continue
        for B, n in spec.get("decode", []):
            add(("decode", B, n), "decode", {"batch": B, "n": n, "min_total": 1.0}, r)
        for L in spec.get("ttft", []):
            add(("ttft", L), "ttft", {"length": L, "min_total": 1.0}, r)
        if spec.get("itl") and has[r]["stream"]:
            add(("itl", spec["itl"]), "itl", {"n": spec["itl"]}, r)
        if spec.get("steps") and has[r]["steps"]:
            for B in [1, *spec.get("step_batches", [])]:  # every position in one turn
                add(("step", B), "step", {"positions": list(spec["steps"]), "batch": B,
                                          "count": spec.get("step_count", 16)}, r)
        if spec.get("score") and has[r]["score"]:
            nseq, T = spec["score"]
            add(("score", nseq, T), "score", {"sequences": nseq, "tokens": T,
                                              "min_total": 1.0}, r)
        for shared, tail in spec.get("prefix", []):
            add(("prefix", shared, tail), "prefix", {"shared": shared, "tail": tail,
                                                     "min_total": 1.0}, r)
        if spec.get("chat"):
            c = spec["chat"]
            add(("chat", c["turns"]), "chat", dict(c), r)
        if spec.get("spec") and code_prompts:
            sp = spec["spec"]
            for B in sp["batches"]:
                # (the op is Worker.speculation: Worker.spec is the runner's plan)
                add(("spec", B), "speculation", {"prompts": code_prompts[:sp["files"]],
                                                 "batch": B, "n": sp["n"], "min_total": 1.0},
                    r)
    order = {"decode": 0, "ttft": 1, "itl": 2, "step": 3, "score": 4, "prefix": 5, "chat": 6,
             "spec": 7}
    return sorted(found.values(), key=lambda c: (order[c.key[0]], c.key[1:]))


def runner_spec(name: str, spec: dict, paths: dict) -> dict:
    """What a runner process is started with: the paths, its plan entry, and its kind (a
    plan entry may name it: ``engine_on`` is an engine with the server's speed features)."""
    full = {**paths, **spec}
    full.pop("code_prompts", None)  # (sent with each spec cell, not at start)
    kind = name.split("_")[0]
    full["runner"] = spec.get("runner") or \
        (kind if kind in ("engine", "llamacpp", "matmuls") else name)
    full["name"] = name
    if name.endswith("_int8"):  # (engine_int8, matmuls_int8)
        full["artifact"] = paths["int8_artifact"]
    if name.endswith("_int4"):
        full["artifact"] = paths["int4_artifact"]
    return full


SETTLE = 0.3  # seconds before each turn (see the module's docstring)


def run_turns(plan: dict[str, dict], paths: dict, rounds: int, workdir: Path,
              settle: float = SETTLE) -> dict:
    """Every runner of ``plan`` alive at once, taking turns cell by cell for ``rounds`` rounds
    (a runner whose plan says ``repeats: 1`` takes part in the first round only). Returns
    runner -> results in the shape ``bench/report.py`` reads."""
    workdir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, RunnerProcess] = {}
    out: dict[str, dict] = {}
    for name, spec in plan.items():  # one at a time: load times are the runner's own
        full = runner_spec(name, spec, paths)
        log.info("loading %s", name)
        p = RunnerProcess(name, full, workdir / f"runner-{name}.log")
        if p.loaded is None:
            out[name] = {"error": p.error}
            p.close()
            continue
        procs[name] = p
        out[name] = {k: v for k, v in p.loaded.items() if k != "has"}
    has = {n: p.loaded["has"] for n, p in procs.items()}
    for name, p in procs.items():
        w = p.call("warmup")
        if w:
            out[name].update(w)
    turns: dict[tuple, dict[str, list[dict]]] = {}
    cells = cells_of(plan, has, paths.get("code_prompts"))  # (a runner that failed to load
    # has no cells)
    for k in range(rounds):
        for i, cell in enumerate(cells):
            who = [r for r in cell.who if k < plan[r].get("repeats", rounds)]
            if (i + k) % 2:
                who = who[::-1]
            for r in who:
                time.sleep(settle)  # the previous turn's threads stop spinning
                got = procs[r].call(cell.op, **cell.args)
                if got is not None:
                    got["round"] = k
                    turns.setdefault(cell.key, {}).setdefault(r, []).append(got)
        log.info("round %d of %d done", k + 1, rounds)
    for name, p in procs.items():
        out[name].update(p.close())
        out[name]["turns"] = sum(len(v.get(name, [])) for v in turns.values())
        if p.error:
            out[name]["error"] = p.error
    for key, per_runner in turns.items():
        for r, got in per_runner.items():
            _best(out[r], key, got, plan[r].get("prompt_len"), rounds)
    if "grpc" in out and out["grpc"].get("decode"):
        out["grpc"]["grpc"] = _grpc_summary(out["grpc"])
    return out


def _best(res: dict, key: tuple, got: list[dict], prompt: int | None, rounds: int) -> None:
    """A runner's turns at one cell -> its entry in the results: the best turn, and for a
    decode cell every turn's tok/s by round (None where it took no turn), which the report
    pairs with another runner's turn of the same round."""
    op = key[0]
    if op == "decode":
        B, n = key[1:]
        best = min(t["seconds"] for t in got)
        by_round: list[float | None] = [None] * rounds
        for t in got:
            by_round[t["round"]] = round(B * n / t["seconds"], 1)
        while by_round and by_round[-1] is None:
            by_round.pop()
        res.setdefault("decode", {})[f"{B}x{n}"] = {
            "batch": B, "new_tokens": n, "prompt": prompt, "seconds": best,
            "tok_s": B * n / best, "turns_tok_s": by_round}
    elif op == "ttft":
        res.setdefault("ttft_ms", {})[str(key[1])] = min(t["ms"] for t in got)
    elif op == "itl":
        res["itl_ms"] = min(got, key=lambda t: t["p50"])
    elif op == "step":  # every position: its best turn; and each turn's figures (one turn's
        # positions were measured interleaved: their ratios are that turn's own)
        B = key[1]
        name = "step_ms" if B == 1 else f"step_ms_batch{B}"
        res[name] = {pos: min(t["ms"][pos] for t in got) for pos in got[0]["ms"]}
        res[name + "_turns"] = [t["ms"] for t in got]
    elif op in speed_cells.BEST:  # prefix, chat, spec
        group, name, entry = speed_cells.best_turns(key, got, rounds)
        res.setdefault(group, {})[name] = entry
    elif op == "score":
        nseq, T = key[1:]
        t = min(got, key=lambda t: t["seconds"])
        res["score"] = {"sequences": nseq, "tokens": T, "seconds": t["seconds"],
                        "tok_s": nseq * T / t["seconds"], "logprob_sum": t["logprob_sum"]}


def _grpc_summary(res: dict) -> dict:
    """The gRPC runner's cells as the report names them: one stream and N concurrent ones."""
    cells = sorted(res["decode"].values(), key=lambda c: c["batch"])
    one, many = cells[0], cells[-1]
    return {"single_tok_s": one["tok_s"], "single_seconds": one["seconds"],
            "concurrent_streams": many["batch"], "concurrent_tok_s": many["tok_s"],
            "concurrent_seconds": many["seconds"], "new_tokens": many["new_tokens"],
            "server_rss_peak_mb": res.get("server_rss_peak_mb"),
            "client_rss_peak_mb": res.get("rss_peak_mb")}

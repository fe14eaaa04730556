"""The runner processes: one each (``python -m kvserve.bench.runners SPEC_JSON``), so that peak
RSS is attributable to one runner and no runner warms another's caches or shares its GIL. The
processes stay alive side by side and take turns, cell by cell (``bench/turns.py``): each
answers one measurement per command on stdin (``Worker``). The runners themselves:
``runner_base`` (the interface), ``runner_kvserve`` (engine, loop), ``runner_peers`` (torch, hf,
genai), ``runner_grpc`` (grpc), ``runner_llamacpp`` (llamacpp, when llama-cpp-python is
installed).

Every runner offers the same operations on the same token ids:
  generate(prompts (B, P) int, n) -> (B, n) greedy tokens   (decode tok/s, TTFT = n of 1)
  stream(prompt (P,), n) -> n token arrival times            (inter-token latency, batch 1)
  steps_ms(positions, steps, batch) -> median decode step time at each position (where the
                           runner has steps; batch 1 and the plan's step_batches), the positions
                           interleaved in blocks within one turn
  score(sequences) -> per-token log-probabilities             (Score tokens/s)
  timed(prompts, n) -> tokens, first-token and total seconds   (the prefix cache's and
                           speculation's cells: ``bench/speed_cells.py``)
What each runner is:
  engine  kvserve's continuous-batching Engine (server/engine.py), in-process: N requests
          submitted together, tokens collected from the handles
  loop    the raw runner loop (kvserve.artifact: FusedLM + DeviceKV for a fused artifact):
          prefill into the cache, decode steps with greedy argmax; no engine, no detokenizer
  torch   kvserve's torch model, eager (model/generate.py)
  hf      Hugging Face transformers LlamaForCausalLM.generate, eager attention, same weights
  genai   onnxruntime-genai 0.18 Generator API, greedy, batch via set_search_options
  grpc    kvserve serve (a subprocess) driven by the Python gRPC client (clients/client.py):
          batch B = B concurrent streams
  engine_on  the engine with kvserve serve's defaults: prefix cache and speculation on
  llamacpp   llama-cpp-python on a GGUF of the same weights (f32; llamacpp_q8 / _q4: q8_0 /
          q4_0), batch B = B sequences of one context
  matmuls    the floor of kvserve's kernels (``runner_floor``): the artifact's matrix products
          alone at each call's shape (fp32; matmuls_int8 / _int4: those artifacts), no tokens
Timing: wall clock (time.perf_counter) around each call; within a turn, calls repeat while
they took under a second together (``best_of``).
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

from . import speed_cells
from .runner_base import Runner, prompts_for, rss_now_mb, rss_peak_mb
from .runner_grpc import GrpcRunner
from .runner_kvserve import EngineRunner, LoopRunner
from .runner_peers import GenaiRunner, HFRunner, TorchRunner


# --- the measurement plan ----------------------------------------------------------------------
def make_runner(spec: dict) -> Runner:
    kind, t = spec["runner"], spec["threads"]
    if kind == "engine":
        spec_batches = (spec.get("spec") or {}).get("batches", [])
        return EngineRunner(spec["artifact"], t,
                            max_batch=max(spec.get("batches", [1]) + spec_batches + [1]),
                            prefix_cache_mb=spec.get("prefix_cache_mb", 0),
                            speculative_tokens=spec.get("speculative_tokens", 0))
    if kind == "loop":
        return LoopRunner(spec["artifact"], t)
    if kind == "torch":
        return TorchRunner(spec["ckpt"], t)
    if kind == "hf":
        return HFRunner(spec["hf"], t)
    if kind == "genai":
        return GenaiRunner(spec["genai"], t, spec["vocab"])
    if kind == "llamacpp":
        from .runner_llamacpp import LlamaCppRunner

        r = LlamaCppRunner(spec["gguf"][spec.get("quant", "f32")], t)
        r.name = spec.get("name", "llamacpp")
        return r
    if kind == "matmuls":
        from .runner_floor import MatmulFloorRunner

        r = MatmulFloorRunner(spec["artifact"], t)
        r.name = spec.get("name", "matmuls")
        return r
    if kind == "grpc":
        return GrpcRunner(spec["artifact"], t, max(b for b, _ in spec["decode"]),
                          Path(spec["workdir"]))
    raise ValueError(f"unknown runner {kind!r}")


def best_of(fn, repeats: int, min_total: float = 1.0, max_repeats: int = 10
            ) -> tuple[float, object]:
    """Best wall time of at least ``repeats`` calls, more (up to ``max_repeats``) while the
    calls together took under ``min_total`` seconds: millisecond-scale cells get enough
    samples to see through scheduler noise, long ones are not repeated needlessly."""
    best, out, total, k = float("inf"), None, 0.0, 0
    while k < max(1, repeats) or (total < min_total and k < max_repeats):
        t0 = time.perf_counter()
        r = fn()
        dt = time.perf_counter() - t0
        total, k = total + dt, k + 1
        if dt < best:
            best, out = dt, r
    return best, out


class Worker:
    """One runner, loaded once, answering the orchestrator's measurements one turn at a time
    (``bench/turns.py``). Each operation returns a JSON-able dict."""

    def __init__(self, spec: dict):
        rss0 = rss_now_mb()
        t0 = time.perf_counter()
        self.spec, self.r = spec, make_runner(spec)
        self.vocab, self.P = spec["vocab"], spec["prompt_len"]
        self.loaded = {"runner": self.r.name, "load_seconds": time.perf_counter() - t0,
                       "rss_before_load_mb": rss0}
        if getattr(self.r, "lm", None) is not None:  # kvserve's runners: which runtime
            self.loaded["runtime"] = self.r.lm.kind
            quant = self.r.lm.manifest.get("quantization")  # (int4: its block size)
            if quant:
                self.loaded["quantization"] = quant
        for k in ("prefix_cache_mb", "speculative_tokens", "quant"):  # (engine_on, llamacpp)
            if k in spec:
                self.loaded[k] = spec[k]
        self.loaded["has"] = {"steps": self.r.has_steps, "stream": self.r.has_stream,
                              "score": self.r.has_score}
        self._scored = False
        self._serials = itertools.count()  # a fresh shared prefix / conversation each time

    def warmup(self) -> dict:
        """Every batch size once, a few tokens; the greedy tokens of a fixed prompt."""
        if isinstance(self.r, GrpcRunner):
            self.r.generate(prompts_for(1, 8, self.vocab), 4)  # connection, first call
        for B in self.spec.get("batches", []):
            self.r.generate(prompts_for(B, self.P, self.vocab), 4)
        if not self.spec.get("sample_tokens"):
            return {}
        return {"sample_tokens": self.r.generate(prompts_for(1, self.P, self.vocab),
                                                 16)[0].tolist()}

    def decode(self, batch: int, n: int, min_total: float) -> dict:
        prompts = prompts_for(batch, self.P, self.vocab)
        secs, toks = best_of(lambda: self.r.generate(prompts, n), 1, min_total)
        if toks.shape != (batch, n):
            raise RuntimeError(f"{self.r.name} returned {toks.shape}, not {(batch, n)}")
        return {"seconds": secs}

    def ttft(self, length: int, min_total: float) -> dict:
        prompt = prompts_for(1, length, self.vocab, seed=5)
        secs, _ = best_of(lambda: self.r.generate(prompt, 1), 2, min_total)
        return {"ms": 1000 * secs}

    def itl(self, n: int) -> dict:
        times = self.r.stream(prompts_for(1, self.P, self.vocab)[0], n)
        gaps = np.diff(np.asarray(times)) * 1000
        out = {"p50": float(np.percentile(gaps, 50)), "p99": float(np.percentile(gaps, 99)),
               "mean": float(gaps.mean()), "n": int(len(gaps))}
        if getattr(self.r, "decode_share", None):
            out["engine_time_split"] = self.r.decode_share
        return out

    def step(self, positions: list[int], batch: int, count: int) -> dict:
        return {"ms": self.r.steps_ms(positions, count, batch)}

    def score(self, sequences: int, tokens: int, min_total: float) -> dict:
        seqs = prompts_for(sequences, tokens, self.vocab, seed=11).tolist()
        if not self._scored:
            self.r.score(seqs[:1])  # warm-up
            self._scored = True
        secs, lps = best_of(lambda: self.r.score(seqs), 1, min_total)
        return {"seconds": secs, "logprob_sum": float(sum(np.sum(x) for x in lps))}

    def prefix(self, shared: int, tail: int, min_total: float) -> dict:
        return speed_cells.prefix(self.r, self.vocab, shared, tail, self._serials, min_total)

    def chat(self, turns: int, first: int, user: int, reply: int) -> dict:
        return speed_cells.chat(self.r, self.vocab, turns, first, user, reply,
                                next(self._serials))

    def speculation(self, prompts: list[list[int]], batch: int, n: int, min_total: float
                    ) -> dict:
        return speed_cells.best_spec(self.r, prompts, batch, n, min_total)

    def finish(self) -> dict:
        extra = self.r.extra()
        self.r.close()
        return {**extra, "rss_peak_mb": rss_peak_mb()}


REPLY = "@kvserve-bench "  # the prefix of the worker's answers on stdout (libraries print too)


def serve_turns(spec: dict) -> None:
    """The runner process: load, say so, then answer one JSON command per stdin line
    (``{"op": name, **arguments}``) with one line ``REPLY {"ok": ...}`` or ``{"error": ...}``
    until ``finish`` or the end of stdin."""
    try:
        w = Worker(spec)
        print(REPLY + json.dumps({"ok": w.loaded}), flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator
        print(REPLY + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            print(REPLY + json.dumps({"ok": getattr(w, op)(**cmd)}), flush=True)
        except Exception as e:  # noqa: BLE001 - one cell failing must not lose the others
            print(REPLY + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        if op == "finish":
            return


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    serve_turns(json.loads(sys.argv[1]))

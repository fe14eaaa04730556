"""The runners: one process each (``python -m kvserve.bench.runners SPEC_JSON``), so that peak RSS
is attributable to one runner and no runner warms another's caches or shares its GIL. The
processes stay alive side by side and take turns, cell by cell (``bench/turns.py``): each
answers one measurement per command on stdin (``Worker``).

Every runner offers the same operations on the same token ids:
  generate(prompts (B, P) int, n) -> (B, n) greedy tokens   (decode tok/s, TTFT = n of 1)
  stream(prompt (P,), n) -> n token arrival times            (inter-token latency, batch 1)
  steps_ms(positions, steps, batch) -> median decode step time at each position (where the
                           runner has steps; batch 1 and the plan's step_batches), the positions
                           interleaved in blocks within one turn
  score(sequences) -> per-token log-probabilities             (Score tokens/s)
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
Timing: wall clock (time.perf_counter) around each call; within a turn, calls repeat while
they took under a second together (``best_of``).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from .common import memory_mb

STEP_BLOCK = 4  # timed decode steps at one position before the next position's


def rss_peak_mb() -> float:
    """This process's peak RSS (MiB)."""
    return memory_mb("VmHWM")


def rss_now_mb() -> float:
    return memory_mb("VmRSS")


def prompts_for(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Fixed random prompts (B, P), never the special ids 0/1."""
    rng = np.random.default_rng(seed)
    return rng.integers(2, vocab, size=(batch, length), dtype=np.int64)


# --- runners -----------------------------------------------------------------------------------
class Runner:
    name = "?"
    has_steps = False
    has_score = False
    has_stream = False

    def generate(self, prompts: np.ndarray, n: int) -> np.ndarray:
        raise NotImplementedError

    def stream(self, prompt: np.ndarray, n: int) -> list[float]:
        raise NotImplementedError

    def walker(self, position: int, steps: int, batch: int = 1):
        """A sequence of ``batch`` rows at ``position`` with room for ``steps`` more tokens;
        returns step() -> seconds of one greedy decode step (the step timed alone)."""
        raise NotImplementedError

    def steps_ms(self, positions: list[int], steps: int, batch: int = 1,
                 block: int = STEP_BLOCK) -> dict[str, float]:
        """Median decode step (ms) at each position, the positions measured interleaved in
        blocks of ``block`` timed steps, each block after an untimed one (a runner switching
        caches rebuilds its binding): the machine's speed drift spreads over every position
        instead of biasing one, so their ratio is the runner's own."""
        walk = {p: self.walker(p, steps + steps // block + 1, batch) for p in positions}
        times: dict[int, list[float]] = {p: [] for p in positions}
        while any(len(t) < steps for t in times.values()):
            for p in positions:
                walk[p]()
                for _ in range(min(block, steps - len(times[p]))):
                    times[p].append(walk[p]())
        return {str(p): 1000 * statistics.median(t) for p, t in times.items()}

    def score(self, seqs: list[list[int]]) -> list[np.ndarray]:
        raise NotImplementedError

    def extra(self) -> dict:
        """Figures of its own for the results (the gRPC server's peak RSS)."""
        return {}

    def close(self) -> None:
        pass


class LoopRunner(Runner):
    """The artifact's runner and its KV cache, the engine's core without the engine."""
    name = "loop"
    has_steps = True
    has_stream = True

    def __init__(self, artifact: str, threads: int, provider: str = "cpu"):
        from kvserve.artifact.loader import load_lm

        self.lm = load_lm(artifact, provider=provider, threads=threads, attention=False)
        self.cfg = self.lm.cfg

    def start(self, prompts: np.ndarray, capacity: int):
        """Prefill ``prompts`` (B, P) into a new cache of ``capacity`` rows: (cache, the
        greedy first tokens (B,))."""
        kv = self.lm.new_cache(len(prompts), capacity=capacity)
        res = self.lm.prefill(kv, 0, list(prompts), last=True)
        return kv, np.array([x[-1].argmax() for x in res.logits], np.int64)

    def generate(self, prompts, n, times: list | None = None):
        B, P = prompts.shape
        kv, tok = self.start(prompts, P + n + 1)
        out = np.empty((B, n), np.int64)
        out[:, 0] = tok
        if times is not None:
            times.append(time.perf_counter())
        for i in range(1, n):
            logits, _ = self.lm.decode(kv, B, tok)
            tok = logits.argmax(-1)
            out[:, i] = tok
            if times is not None:
                times.append(time.perf_counter())
        return out

    def stream(self, prompt, n):
        times: list[float] = []
        self.generate(prompt[None], n, times)
        return times

    def walker(self, position, steps, batch=1):
        prompt = prompts_for(batch, position, self.cfg.vocab_size, seed=7)
        kv, tok = self.start(prompt, position + steps + 3)
        state = [tok]

        def step() -> float:
            t0 = time.perf_counter()
            logits, _ = self.lm.decode(kv, batch, state[0])
            state[0] = logits.argmax(-1)
            return time.perf_counter() - t0
        return step


class RecordingMetrics:
    """The engine's metrics hooks (server.interfaces.EngineMetrics), recording what the engine itself
    measures: the gap between a sequence's tokens (inter-token latency as the engine sees it,
    free of the consumer thread's wake-up) and the time inside the runner's ``decode`` per
    step."""

    def __init__(self):
        self.gaps: list[float] = []
        self.steps: list[tuple[int, float]] = []

    def queue_depth(self, n): ...
    def running(self, n): ...
    def admitted(self, queue_seconds, prompt_tokens): ...
    def finished(self, reason, generated): ...

    def token(self, first, seconds):
        if not first:
            self.gaps.append(seconds)

    def step(self, batch, seconds):
        self.steps.append((batch, seconds))


class EngineRunner(Runner):
    """The real continuous-batching engine, in-process."""
    name = "engine"
    has_score = True
    has_stream = True

    def __init__(self, artifact: str, threads: int, max_batch: int = 16):
        from tokenizers import Tokenizer as HFTokenizer

        from kvserve.artifact.loader import load_lm
        from kvserve.server.config import ServerConfig
        from kvserve.server.detok import TokenBytes
        from kvserve.server.engine import Engine

        self.lm = load_lm(artifact, provider="cpu", threads=threads, attention=False)
        self.cfg = self.lm.cfg
        tb = TokenBytes(HFTokenizer.from_file(str(Path(artifact) / "tokenizer.json")),
                        self.cfg.vocab_size)
        c = ServerConfig()  # the server's defaults
        self.engine = Engine(self.lm, tb, max_batch=max_batch, max_queue=256,
                             score_chunk_floats=c.score_chunk_floats,
                             stream_interval=c.stream_interval_ms / 1000,
                             stream_interval_max=c.stream_interval_max_ms / 1000,
                             prefill_chunk_tokens=c.prefill_chunk_tokens,
                             eos_id=self.cfg.eos_token_id, metrics=RecordingMetrics())
        self.metrics = self.engine.metrics
        self.engine.start()

    def _request(self, prompt, n):
        from kvserve.model.sampling import SamplingParams
        from kvserve.server.domain import GenerateRequest, OutputParams, StopParams

        return GenerateRequest(prompt_ids=[int(t) for t in prompt], sampling=SamplingParams(),
                               stopping=StopParams(max_new_tokens=n, ignore_eos=True),
                               output=OutputParams())

    def _submit_all(self, prompts, n):
        return self.engine.submit_many([self._request(p, n) for p in prompts])

    def generate(self, prompts, n):
        from kvserve.server.domain import FinishEvent, TokenEvent

        handles = self._submit_all(prompts, n)
        out = np.zeros((len(prompts), n), np.int64)
        for b, h in enumerate(handles):
            for ev in h:
                if isinstance(ev, TokenEvent):
                    out[b, ev.index] = ev.token_id
                elif isinstance(ev, FinishEvent) and ev.generated_tokens != n:
                    raise RuntimeError(f"engine finished early: {ev.reason} {ev.error}")
        return out

    def stream(self, prompt, n):
        self.metrics.gaps.clear()
        self.metrics.steps.clear()
        t0 = time.perf_counter()
        (h,) = self._submit_all(prompt[None], n)
        for ev in h:
            pass
        wall = time.perf_counter() - t0
        # the engine's own clock: t0 + cumulative inter-token gaps (first token at the gap sum's
        # start is irrelevant to the differences taken by the caller)
        inside = sum(s for _, s in self.metrics.steps)
        self.decode_share = {"decode_steps": len(self.metrics.steps),
                             "seconds_in_runner_decode": inside, "wall_seconds": wall,
                             "share_in_decode": inside / wall}
        return list(np.cumsum([0.0, *self.metrics.gaps]))

    def score(self, seqs):
        from kvserve.server.domain import ScoreRequest

        _, fut = self.engine.submit_score(ScoreRequest(sequences=[list(map(int, s))
                                                                  for s in seqs]))
        return [r.logprobs for r in fut.result()]

    def close(self):
        self.engine.stop()


def _torch_score(torch, model, seqs) -> list[np.ndarray]:
    """Per-token logprobs of a batch of equal-length sequences by one full forward (any model
    whose output has ``.logits``: kvserve's and transformers')."""
    with torch.no_grad():
        x = torch.tensor(np.asarray(seqs, np.int64))
        lp = torch.log_softmax(model(x).logits.float(), -1)
        return list(lp[:, :-1].gather(-1, x[:, 1:, None])[..., 0].numpy())


class TorchRunner(Runner):
    """kvserve's torch model, eager, via model.generate (prefill + one step per token)."""
    name = "torch"
    has_score = True

    def __init__(self, ckpt: str, threads: int):
        import torch

        from kvserve.model.checkpoint import load_model

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = load_model(ckpt).eval()
        self.cfg = self.model.cfg

    def generate(self, prompts, n):
        from kvserve.model.generate import generate

        g = generate(self.model, prompts.tolist(), n, eos_id=None)
        return np.asarray(g.tokens, np.int64)

    def score(self, seqs):
        return _torch_score(self.torch, self.model, seqs)


class HFRunner(Runner):
    """transformers LlamaForCausalLM, eager attention, greedy generate."""
    name = "hf"
    has_score = True

    def __init__(self, hf_dir: str, threads: int):
        import torch
        import transformers as tf

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = tf.LlamaForCausalLM.from_pretrained(
            hf_dir, attn_implementation="eager", dtype=torch.float32).eval()

    def generate(self, prompts, n):
        x = self.torch.tensor(prompts)
        with self.torch.no_grad():
            out = self.model.generate(x, attention_mask=self.torch.ones_like(x),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      num_beams=1, pad_token_id=1, use_cache=True)
        return out[:, prompts.shape[1]:].numpy()

    def score(self, seqs):
        return _torch_score(self.torch, self.model, seqs)


class GenaiRunner(Runner):
    """onnxruntime-genai Generator API, greedy (its model builder's graph of the same HF dir)."""
    name = "genai"
    has_steps = True
    has_stream = True

    def __init__(self, genai_dir: str, threads: int, vocab: int):
        import onnxruntime_genai as og

        self.og, self.vocab = og, vocab
        self.model = og.Model(genai_dir)

    def _generator(self, batch, max_length):
        p = self.og.GeneratorParams(self.model)
        # min_length = max_length: no early EOS, every runner makes exactly n tokens
        p.set_search_options(batch_size=batch, max_length=max_length, min_length=max_length,
                             do_sample=False)
        return self.og.Generator(self.model, p)

    def generate(self, prompts, n, times: list | None = None):
        B, P = prompts.shape
        g = self._generator(B, P + n)
        g.append_tokens(prompts.astype(np.int32))
        while not g.is_done():
            g.generate_next_token()
            if times is not None:
                times.append(time.perf_counter())
        out = np.stack([g.get_sequence(b)[P:P + n] for b in range(B)]).astype(np.int64)
        del g
        return out

    def stream(self, prompt, n):
        times: list[float] = []
        self.generate(prompt[None], n, times)
        return times

    def walker(self, position, steps, batch=1):
        prompt = prompts_for(batch, position, self.vocab, seed=7).astype(np.int32)
        g = self._generator(batch, position + steps + 2)
        g.append_tokens(prompt)
        g.generate_next_token()  # (the prefill's token: as the loop's start)

        def step() -> float:
            t0 = time.perf_counter()
            g.generate_next_token()
            return time.perf_counter() - t0
        return step


# --- gRPC --------------------------------------------------------------------------------------
class Server:
    """``kvserve serve`` in a subprocess on a free port; its peak RSS read from /proc."""

    def __init__(self, artifact: str, threads: int, max_batch: int, workdir: Path):
        import subprocess

        port_file = workdir / f"port-{os.getpid()}.json"
        port_file.unlink(missing_ok=True)
        self.log = open(workdir / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "serve", artifact, "--port", "0",
             "--port-file", str(port_file), "--threads", str(threads), "--max-batch",
             str(max_batch), "--max-queue", "64", "--no-verify", "--log-level", "WARNING"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not port_file.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start; see {workdir / 'server.log'}")
            time.sleep(0.1)
        self.port = json.loads(port_file.read_text())["port"]

    def peak_rss_mb(self) -> float:
        return memory_mb("VmHWM", self.proc.pid)

    def stop(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
        self.log.close()


class GrpcRunner(Runner):
    """``kvserve serve`` in a subprocess driven by the Python gRPC client: a batch of B prompts
    is B concurrent streams (one thread each), a batch of 1 is one stream. The server's
    ``--max-batch`` is the largest batch asked for."""
    name = "grpc"

    def __init__(self, artifact: str, threads: int, max_batch: int, workdir: Path):
        from kvserve.clients.client import Client

        workdir.mkdir(parents=True, exist_ok=True)
        self.server = Server(artifact, threads, max_batch=max_batch, workdir=workdir)
        self.client = Client(f"127.0.0.1:{self.server.port}", timeout=600)

    def _one(self, prompt, n) -> list[int]:
        return [ev.id for ev in self.client.generate_stream([int(t) for t in prompt],
                                                            max_new_tokens=n, ignore_eos=True)
                if ev.type == "token"]

    def generate(self, prompts, n):
        out: list = [None] * len(prompts)

        def worker(i):
            out[i] = self._one(prompts[i], n)

        if len(prompts) == 1:
            worker(0)
        else:
            threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if any(o is None or len(o) != n for o in out):
            raise RuntimeError(f"a stream did not deliver {n} tokens")
        return np.array(out, np.int64)

    def extra(self) -> dict:
        return {"server_rss_peak_mb": self.server.peak_rss_mb()}

    def close(self):
        self.client.close()
        self.server.stop()


# --- the measurement plan ----------------------------------------------------------------------
def make_runner(spec: dict) -> Runner:
    kind, t = spec["runner"], spec["threads"]
    if kind == "engine":
        return EngineRunner(spec["artifact"], t, max_batch=max(spec.get("batches", [1]) + [1]))
    if kind == "loop":
        return LoopRunner(spec["artifact"], t)
    if kind == "torch":
        return TorchRunner(spec["ckpt"], t)
    if kind == "hf":
        return HFRunner(spec["hf"], t)
    if kind == "genai":
        return GenaiRunner(spec["genai"], t, spec["vocab"])
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
        self.loaded["has"] = {"steps": self.r.has_steps, "stream": self.r.has_stream,
                              "score": self.r.has_score}
        self._scored = False

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

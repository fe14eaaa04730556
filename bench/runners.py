"""The runners: one process each (``python -m kvserve.bench.runners SPEC_JSON``), so that peak RSS
is attributable to one runner and no runner warms another's caches or shares its GIL.

Every runner offers the same operations on the same token ids:
  generate(prompts (B, P) int, n) -> (B, n) greedy tokens   (decode tok/s, TTFT = n of 1)
  stream(prompt (P,), n) -> n token arrival times            (inter-token latency, batch 1)
  step_ms(position, batch) -> median decode step time at that position (where the runner has
                           steps), batch 1 and the plan's step_batches
  score(sequences) -> per-token log-probabilities             (Score tokens/s)
What each runner is:
  engine  kvserve's continuous-batching Engine (server/engine.py), in-process: N requests
          submitted together, tokens collected from the handles
  loop    the raw runner loop (kvserve.artifact: FusedLM + DeviceKV for a fused artifact):
          prefill into the cache, decode steps with greedy argmax; no engine, no detokenizer
  torch   kvserve's torch model, eager (model/generate.py)
  hf      Hugging Face transformers LlamaForCausalLM.generate, eager attention, same weights
  genai   onnxruntime-genai 0.18 Generator API, greedy, batch via set_search_options
  grpc    kvserve serve (a subprocess) driven by the Python gRPC client (clients/client.py)
Timing: wall clock (time.perf_counter) around each call, best of ``repeats`` after a warm-up.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np


def rss_peak_mb() -> float:
    """This process's peak RSS: VmHWM of its own address space. Not ``ru_maxrss``: Linux
    carries that across fork+exec, so a runner would report its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def rss_now_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


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

    def step_ms(self, position: int, steps: int, batch: int = 1) -> float:
        raise NotImplementedError

    def score(self, seqs: list[list[int]]) -> list[np.ndarray]:
        raise NotImplementedError

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
        res = self.lm.prefill(kv, 0, list(prompts))
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

    def step_ms(self, position, steps, batch=1):
        prompt = prompts_for(batch, position, self.cfg.vocab_size, seed=7)
        kv, tok = self.start(prompt, position + steps + 2)
        dts = []
        for _ in range(steps):
            t0 = time.perf_counter()
            logits, _ = self.lm.decode(kv, batch, tok)
            tok = logits.argmax(-1)
            dts.append(time.perf_counter() - t0)
        return 1000 * statistics.median(dts)


class RecordingMetrics:
    """The engine's metrics hooks (server.engine.NullMetrics), recording what the engine itself
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
        self.engine = Engine(self.lm, tb, max_batch=max_batch, max_queue=256,
                             score_chunk_floats=ServerConfig().score_chunk_floats,
                             stream_interval=ServerConfig().stream_interval_ms / 1000,
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

    def step_ms(self, position, steps, batch=1):
        prompt = prompts_for(batch, position, self.vocab, seed=7).astype(np.int32)
        g = self._generator(batch, position + steps + 2)
        g.append_tokens(prompt)
        g.generate_next_token()
        dts = []
        for _ in range(steps):
            t0 = time.perf_counter()
            g.generate_next_token()
            dts.append(time.perf_counter() - t0)
        del g
        return 1000 * statistics.median(dts)


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
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
        return float("nan")

    def stop(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
        self.log.close()


def grpc_bench(spec: dict) -> dict:
    """Single-stream end-to-end tok/s and 16 concurrent streams' aggregate tok/s."""
    from kvserve.clients.client import Client

    workdir = Path(spec["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    streams, n, P = spec["streams"], spec["new_tokens"], spec["prompt_len"]
    srv = Server(spec["artifact"], spec["threads"], max_batch=streams, workdir=workdir)
    try:
        target = f"127.0.0.1:{srv.port}"
        vocab = spec["vocab"]
        prompts = prompts_for(streams, P, vocab, seed=3)
        with Client(target, timeout=600) as c:
            def one(p):
                got = 0
                for ev in c.generate_stream([int(t) for t in p], max_new_tokens=n,
                                            ignore_eos=True):
                    got += ev.type == "token"
                return got

            one(prompts[0][:8])  # warm-up: connection, first call
            single = []
            for _ in range(spec["repeats"]):
                t0 = time.perf_counter()
                got = one(prompts[0])
                single.append(time.perf_counter() - t0)
                assert got == n, got
            conc = []
            for _ in range(spec["repeats"]):
                counts = [0] * streams

                def worker(i):
                    counts[i] = one(prompts[i])

                threads = [threading.Thread(target=worker, args=(i,)) for i in range(streams)]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                conc.append(time.perf_counter() - t0)
                assert sum(counts) == streams * n, counts
        return {"single_tok_s": n / min(single), "single_seconds": min(single),
                "concurrent_streams": streams, "concurrent_tok_s": streams * n / min(conc),
                "concurrent_seconds": min(conc), "server_rss_peak_mb": srv.peak_rss_mb(),
                "client_rss_peak_mb": rss_peak_mb()}
    finally:
        srv.stop()


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


def run_spec(spec: dict) -> dict:
    """Run one runner's plan; every figure it produces goes into the returned dict."""
    if spec["runner"] == "grpc":
        return {"grpc": grpc_bench(spec), "rss_peak_mb": rss_peak_mb()}
    rss0 = rss_now_mb()
    t0 = time.perf_counter()
    r = make_runner(spec)
    res: dict = {"runner": r.name, "load_seconds": time.perf_counter() - t0,
                 "rss_before_load_mb": rss0}
    if getattr(r, "lm", None) is not None:  # kvserve's runners: which artifact runtime
        res["runtime"] = r.lm.kind
    vocab, P = spec["vocab"], spec["prompt_len"]
    rep = spec["repeats"]
    try:
        # warm-up: every batch size once, a few tokens
        for B in spec.get("batches", []):
            r.generate(prompts_for(B, P, vocab), 4)
        decode = {}
        for B, n in spec.get("decode", []):
            prompts = prompts_for(B, P, vocab)
            reps = rep if B * n <= 2048 else max(1, rep - 1)
            secs, toks = best_of(lambda: r.generate(prompts, n), reps)
            assert toks.shape == (B, n), toks.shape
            decode[f"{B}x{n}"] = {"batch": B, "new_tokens": n, "prompt": P, "seconds": secs,
                                  "tok_s": B * n / secs, "repeats": reps}
        res["decode"] = decode
        if spec.get("sample_tokens"):
            res["sample_tokens"] = r.generate(prompts_for(1, P, vocab), 16)[0].tolist()
        ttft = {}
        for L in spec.get("ttft", []):
            prompt = prompts_for(1, L, vocab, seed=5)
            secs, _ = best_of(lambda: r.generate(prompt, 1), rep + 1)
            ttft[str(L)] = 1000 * secs
        res["ttft_ms"] = ttft
        if spec.get("itl") and r.has_stream:
            n = spec["itl"]
            times = r.stream(prompts_for(1, P, vocab)[0], n)
            gaps = np.diff(np.asarray(times)) * 1000
            res["itl_ms"] = {"p50": float(np.percentile(gaps, 50)),
                             "p99": float(np.percentile(gaps, 99)),
                             "mean": float(gaps.mean()), "n": int(len(gaps))}
            if getattr(r, "decode_share", None):
                res["itl_ms"]["engine_time_split"] = r.decode_share
        if spec.get("steps") and r.has_steps:
            res["step_ms"] = {str(pos): r.step_ms(pos, spec.get("step_count", 16))
                              for pos in spec["steps"]}
            for B in spec.get("step_batches", []):  # the same positions, B rows per step
                res[f"step_ms_batch{B}"] = {str(pos): r.step_ms(pos, spec.get("step_count", 16),
                                                               B) for pos in spec["steps"]}
        if spec.get("score") and r.has_score:
            nseq, T = spec["score"]
            seqs = prompts_for(nseq, T, vocab, seed=11).tolist()
            r.score(seqs[:1])  # warm-up
            secs, lps = best_of(lambda: r.score(seqs), rep)
            res["score"] = {"sequences": nseq, "tokens": T, "seconds": secs,
                            "tok_s": nseq * T / secs,
                            "logprob_sum": float(sum(np.sum(x) for x in lps))}
    finally:
        r.close()
    res["rss_peak_mb"] = rss_peak_mb()
    return res


def run_in_subprocess(spec: dict, timeout: float = 1800) -> dict:
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "kvserve.bench.runners", json.dumps(spec)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"runner {spec['runner']} failed ({p.returncode}):\n"
                           f"{p.stderr[-4000:]}")
    return json.loads(lines[-1])


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    out = run_spec(json.loads(sys.argv[1]))
    print(json.dumps(out))

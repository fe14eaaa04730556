"""The serving path on a device, a part of the CUDA check (``kvserve bench --provider cuda``):
the continuous-batching engine with the server's speed features on (prefix cache, n-gram
speculation, interleaved prefill: ``kvserve serve``'s defaults) against the same engine with
them off, on one provider and artifact; and a served request against the in-process one.

- ``exactness``: a fixed workload in waves (a shared prefix twice, the second wave reading the
  pool; prompts that repeat a phrase, so drafts are accepted; seeded sampling; a long prompt
  arriving while two streams decode, fed in chunks): each request's tokens equal with the
  features on and off, and its logprobs within 1e-4;
- ``speed`` (figures of the device it ran on): batch 1 on a repeating prompt, tok/s with
  speculation on and off and the acceptance; a second request's time to first token through a
  cached shared prefix, the cache on and off; batch-1 and batch-8 greedy tok/s, the engine
  with its defaults against the raw runner loop;
- ``server``: ``kvserve serve --provider ...`` on loopback, one greedy request over gRPC, its
  tokens equal to the in-process engine's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

LOGPROB_TOL = 1e-4
CHUNK_TOKENS = 256  # the exactness engines' prefill chunk (and logits cap): a long prompt in 4+


def engine(art: Path, provider: str, threads: int, on: bool, max_batch: int = 8,
           chunk: int = 0, **runner):
    """An in-process engine (``EngineRunner``'s, started): the server's defaults (``on``) or
    the speed features off, callers woken for every token. ``chunk`` (tokens): the prefill
    chunk and the logits cap (0: the server's defaults); ``runner``: ``load_lm``'s keywords."""
    from kvserve.bench.runner_kvserve import EngineRunner
    from kvserve.server.config import ServerConfig

    c = ServerConfig()
    return EngineRunner(str(art), threads, max_batch=max_batch,
                        prefix_cache_mb=c.prefix_cache_mb if on else 0,
                        speculative_tokens=c.speculative_tokens if on else 0,
                        provider=provider, prefill_chunk_tokens=chunk or None,
                        logits_cap_tokens=chunk, stream_interval_ms=0,
                        interleave_prefill=on, **runner).engine


def _request(prompt, n: int, temperature: float = 0.0, seed: int | None = None):
    from kvserve.model.sampling import SamplingParams
    from kvserve.server.domain import GenerateRequest, OutputParams, StopParams

    sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0,
                              seed=seed)
    return GenerateRequest(prompt_ids=[int(t) for t in prompt], sampling=sampling,
                           stopping=StopParams(max_new_tokens=n, ignore_eos=True),
                           output=OutputParams(logprobs=True))


def _drain(handle, out: dict, key: str, counter: list | None = None) -> None:
    from kvserve.server.domain import FinishEvent, TokenEvent

    toks, lps, end = [], [], None
    for ev in handle:
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
            lps.append(ev.logprob)
            if counter is not None:
                counter[0] += 1
        elif isinstance(ev, FinishEvent):
            end = (ev.reason.name, ev.error)
    out[key] = (toks, lps, end)


def workload(vocab: int, ctx: int, seed: int = 11, chunk: int = CHUNK_TOKENS) -> list[dict]:
    """Waves of requests, each ``{"name", "requests": [GenerateRequest], "long": request or
    None}`` (``long`` arrives once the wave's requests decode)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, vocab, min(600, ctx // 3)).tolist()
    phrase = rng.integers(2, vocab, 24).tolist()

    def tail(k):
        return rng.integers(2, vocab, k).tolist()
    waves = [
        {"name": "shared prefix", "requests": [_request(shared + tail(16), 48)
                                               for _ in range(4)]},
        {"name": "shared prefix again (cached)", "requests": [
            _request(shared + tail(16), 48), _request(shared + tail(9), 48),
            _request(shared + tail(16), 48, 0.8, seed=7),
            _request(shared + tail(5), 48, 1.0, seed=8)]},
        {"name": "repeating phrase", "requests": [
            _request(phrase * 5, 96), _request(tail(8) + phrase * 4, 96),
            _request(phrase * 5 + tail(3), 64, 0.7, seed=9)]},
    ]
    long_len = min(4 * chunk - 40, ctx - 64)
    if long_len > chunk:
        waves.append({"name": "long prompt while two stream", "requests": [
            _request(tail(32), 120), _request(phrase * 3, 120)],
            "long": _request(tail(long_len), 16)})
    return waves


def run_workload(engine, waves: list[dict]) -> dict:
    """Every request's (tokens, logprobs, (finish reason, error)) by ``"wave/i"``."""
    out: dict = {}
    for w in waves:
        counters = [[0] for _ in w["requests"]]
        threads = [threading.Thread(target=_drain, args=(h, out, f"{w['name']}/{i}", c))
                   for i, (h, c) in enumerate(zip(engine.submit_many(w["requests"]),
                                                  counters))]
        for t in threads:
            t.start()
        if w.get("long") is not None:
            t0 = time.monotonic()
            while min(c[0] for c in counters) < 4 and time.monotonic() - t0 < 60:
                time.sleep(0.001)
            (h,) = engine.submit_many([w["long"]])
            _drain(h, out, f"{w['name']}/long")
        for t in threads:
            t.join()
    return out


def compare(on: dict, off: dict) -> dict:
    tokens_equal = all(on[k][0] == off[k][0] for k in off)
    worst = 0.0
    for k in off:
        a, b = np.array(on[k][1], float), np.array(off[k][1], float)
        if len(a) == len(b) and len(a):
            worst = max(worst, float(np.abs(a - b).max()))
    errors = sorted({str(v[2]) for v in [*on.values(), *off.values()] if v[2][1]})
    return {"requests": len(off), "tokens_equal": tokens_equal,
            "differing": sorted(k for k in off if on[k][0] != off[k][0]),
            "max_abs_logprob": worst, "errors": errors,
            "tokens": sum(len(v[0]) for v in off.values())}


def exactness(art: Path, provider: str, threads: int) -> dict:
    """The workload with the server's defaults and with the speed features off: the same
    tokens, logprobs within ``LOGPROB_TOL``; and each feature the engine turned on (fp32 and
    paired quantized artifacts: the prefix cache and speculation; fp16 and unpaired quantized
    ones keep them off unless ``--inexact-speedups``, their rows rounding with the call's
    shape) must have worked: cached rows read, drafts accepted."""
    from kvserve.artifact.loader import load_lm

    cfg = load_lm(art, provider="cpu", threads=1, attention=False).cfg
    waves = workload(cfg.vocab_size, cfg.max_seq_len)
    res = {}
    for on in (True, False):
        e = engine(art, provider, threads, on, chunk=CHUNK_TOKENS)
        try:
            res[on] = run_workload(e, waves)
            if on:
                counts = counters(e)
                enabled = {"prefix_cache": e.prefix is not None,
                           "speculation": e.spec is not None}
        finally:
            e.stop()
    out = compare(res[True], res[False])
    out["features_on"], out["enabled"] = counts, enabled
    out["ok"] = out["tokens_equal"] and out["max_abs_logprob"] <= LOGPROB_TOL \
        and not out["errors"] \
        and (counts["cached_prompt_tokens"] > 0 or not enabled["prefix_cache"]) \
        and (counts["accepted"] > 0 or not enabled["speculation"])
    return out


def repeatability(art: Path, provider: str, threads: int) -> dict:
    """Whether the workload's tokens repeat from run to run on this provider: engines with
    the same settings (features off, a fresh one and the first one again; the server's
    defaults twice), each pair compared; and ``runner_replays``: the first run's model calls
    replayed without the engine (``bench.call_replay``) twice on one session and once on a
    fresh one, each call's logits against the engine's and each other's: where replays part,
    what varies lies below the engine's scheduling. (On an H200, fp16: they do;
    bench/results/cuda-repeat.json.)"""
    from kvserve.artifact.loader import load_lm

    from .call_replay import Recording, differing, replay

    cfg = load_lm(art, provider="cpu", threads=1, attention=False).cfg
    waves = workload(cfg.vocab_size, cfg.max_seq_len)
    runs: dict = {}
    recorded = None
    for name, on in (("off_a", False), ("on", True), ("off_b", False), ("on_b", True)):
        e = engine(art, provider, threads, on, chunk=CHUNK_TOKENS)
        rec = None
        try:
            rec = Recording(e) if name == "off_a" else None
            runs[name] = run_workload(e, waves)
            if rec is not None:
                recorded = rec.stop()
                runs["off_a_again"] = run_workload(e, waves)
        finally:
            if rec is not None:
                rec.stop()
            e.stop()
    pairs = (("off_a", "off_a_again"), ("off_a", "off_b"), ("off_b", "on"), ("on", "on_b"),
             ("off_a", "on"))
    out: dict = {f"{a}~{b}": {k: v for k, v in compare(runs[a], runs[b]).items()
                              if k in ("tokens_equal", "differing", "errors")}
                 for a, b in pairs}
    lm = load_lm(art, provider=provider, threads=threads, attention=False)
    first, second = replay(lm, recorded), replay(lm, recorded)
    fresh = replay(load_lm(art, provider=provider, threads=threads, attention=False), recorded)
    out["runner_replays"] = {"engine~replay": differing(recorded.logits, first),
                             "replay~replay": differing(first, second),
                             "replay~fresh_session": differing(first, fresh)}
    return out


def counters(e) -> dict:
    m = e.metrics
    return {"cached_prompt_tokens": m.cached_tokens, "drafted": m.drafted,
            "accepted": m.accepted}


def _tok_s(runner, prompts: np.ndarray, n: int, repeats: int = 3) -> float:
    from kvserve.bench.runners import best_of

    best, _ = best_of(lambda: runner.generate(prompts, n), repeats, min_total=0.0)
    return len(prompts) * n / best


def speed(art: Path, provider: str, threads: int, shared_tokens: int = 1000) -> dict:
    from kvserve.bench.runner_kvserve import EngineRunner, LoopRunner
    from kvserve.server.config import ServerConfig

    c = ServerConfig()
    on = EngineRunner(str(art), threads, max_batch=8, prefix_cache_mb=c.prefix_cache_mb,
                      speculative_tokens=c.speculative_tokens, provider=provider)
    off = EngineRunner(str(art), threads, max_batch=8, provider=provider)
    loop = LoopRunner(str(art), threads, provider=provider)
    V, ctx = on.cfg.vocab_size, on.cfg.max_seq_len
    rng = np.random.default_rng(21)
    out: dict = {}
    try:
        phrase = rng.integers(2, V, 32)
        rep = np.tile(phrase, 6)[None]
        n = min(256, ctx - rep.shape[1] - 1)
        on.generate(rep, 8), off.generate(rep, 8), loop.generate(rep, 8)  # warm
        a, b = _tok_s(on, rep, n), _tok_s(off, rep, n)
        on.timed(rep, n)
        out["speculation_bs1"] = {"tokens": n, "on_tok_s": a, "off_tok_s": b,
                                  "ratio": a / b, "drafted": on.counters["drafted"],
                                  "accepted": on.counters["accepted"]}
        shared_tokens = min(shared_tokens, ctx // 2)
        shared = rng.integers(2, V, shared_tokens)
        ttft = {}
        for name, r in (("on", on), ("off", off)):
            vals = []
            for i in range(4):
                first = np.concatenate([shared, rng.integers(2, V, 16)])[None]
                second = np.concatenate([shared, rng.integers(2, V, 16)])[None]
                r.generate(first, 1)
                _, t_first, _ = r.timed(second, 1)
                vals.append(t_first)
                shared = rng.integers(2, V, shared_tokens)  # a new prefix each round
            ttft[name] = 1e3 * float(np.median(vals))
        out["prefix_ttft_ms"] = {"shared_tokens": shared_tokens, **ttft,
                                 "ratio": ttft["on"] / ttft["off"]}
        for B in (1, 8):
            p = rng.integers(2, V, (B, 32))
            e, lp = _tok_s(on, p, 128), _tok_s(loop, p, 128)
            out[f"plain_bs{B}"] = {"engine_tok_s": e, "loop_tok_s": lp, "ratio": e / lp}
    finally:
        on.close()
        off.close()
    return out


def server(art: Path, provider: str, threads: int, timeout: float = 120.0) -> dict:
    """``kvserve serve`` on loopback; one greedy request over gRPC against the in-process
    engine's tokens."""
    from kvserve.clients.client import Client

    prompt = np.random.default_rng(31).integers(2, 200, 24).tolist()
    e = engine(art, provider, threads, True)
    got: dict = {}
    try:
        _drain(e.submit(_request(prompt, 32)), got, "x")
    finally:
        e.stop()
    with tempfile.TemporaryDirectory() as d:
        port_file = Path(d) / "port"
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", str(art), "--port", "0",
               "--port-file", str(port_file), "--provider", provider,
               "--threads", str(threads)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "KVSERVE_LOG_LEVEL": "WARNING"})
        try:
            t0 = time.monotonic()
            while not port_file.is_file() or not port_file.read_text().strip():
                if proc.poll() is not None or time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"server did not start: {proc.stderr.read()[-2000:]}")
                time.sleep(0.2)
            port = json.loads(port_file.read_text())["port"]
            with Client(f"127.0.0.1:{port}") as c:
                info = c.model_info()
                done = c.generate(prompt, max_new_tokens=32, ignore_eos=True)
        finally:
            proc.terminate()
            proc.wait(30)
    served = [int(t.id) for t in done.tokens]
    return {"tokens_equal": served == got["x"][0], "tokens": len(served),
            "model_info_provider": info.provider, "cached_prompt_tokens": done.cached_prompt_tokens}

"""kvserve's own runners, in-process: the raw runner loop (``loop``) and the continuous-batching
engine (``engine``)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .runner_base import Runner, prompts_for


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
    """The engine's metrics hooks (server.interfaces.EngineMetrics), recording what the engine
    itself measures: the gap between a sequence's tokens (inter-token latency as the engine
    sees it, free of the consumer thread's wake-up) and the time inside the runner's
    ``decode`` per step."""

    def __init__(self):
        self.gaps: list[float] = []
        self.steps: list[tuple[int, float]] = []
        # prompt tokens cached (the pool or the slot's kept rows); draft tokens verified, accepted
        self.cached_tokens = self.drafted = self.accepted = self.forced = 0
        self.last_first = 0.0

    def queue_depth(self, n): ...
    def running(self, n): ...
    def admitted(self, queue_seconds, prompt_tokens): ...
    def finished(self, reason, generated): ...

    def token(self, first, seconds):
        if not first:
            self.gaps.append(seconds)
        else:  # (when the last sequence of a batch got its first token: its decode begins)
            self.last_first = time.perf_counter()

    def step(self, batch, seconds):
        self.steps.append((batch, seconds))

    def prefix_hit(self, tokens):
        self.cached_tokens += tokens

    def speculated(self, drafted, accepted):
        self.drafted += drafted
        self.accepted += accepted

    def fast_forwarded(self, tokens):
        self.forced += tokens

    def iteration_failed(self, restarted): ...


class EngineRunner(Runner):
    """The real continuous-batching engine, in-process. ``prefix_cache_mb`` and
    ``speculative_tokens`` as ``kvserve serve``'s flags (0: off, the Engine's own default;
    ``engine_on`` in the plan runs the server's defaults); ``inexact_speedups`` as
    ``--inexact-speedups`` (unpaired int8 / int4 artifacts: the prefix cache and speculation
    on there too). The rest as the server's defaults unless given: ``prefill_chunk_tokens``,
    ``logits_cap_tokens`` (``--score-chunk-floats`` as that many tokens' logits),
    ``stream_interval_ms``, ``interleave_prefill``; ``runner``: ``load_lm``'s keywords."""
    name = "engine"
    has_score = True
    has_stream = True

    def __init__(self, artifact: str, threads: int, max_batch: int = 16,
                 prefix_cache_mb: int = 0, speculative_tokens: int = 0,
                 inexact_speedups: bool = False, provider: str = "cpu",
                 prefill_chunk_tokens: int | None = None, logits_cap_tokens: int = 0,
                 stream_interval_ms: float | None = None, interleave_prefill: bool = True,
                 **runner):
        from tokenizers import Tokenizer as HFTokenizer

        from kvserve.artifact.loader import load_lm
        from kvserve.server.config import ServerConfig
        from kvserve.server.detok import TokenBytes
        from kvserve.server.engine import Engine

        self.lm = load_lm(artifact, provider=provider, threads=threads, attention=False,
                          **runner)
        self.cfg = self.lm.cfg
        tb = TokenBytes(HFTokenizer.from_file(str(Path(artifact) / "tokenizer.json")),
                        self.cfg.vocab_size)
        c = ServerConfig()  # the server's defaults
        self.engine = Engine(self.lm, tb, max_batch=max_batch, max_queue=256,
                             score_chunk_floats=logits_cap_tokens * self.cfg.vocab_size
                             if logits_cap_tokens else c.score_chunk_floats,
                             stream_interval=(c.stream_interval_ms if stream_interval_ms is None
                                              else stream_interval_ms) / 1000,
                             stream_interval_max=c.stream_interval_max_ms / 1000,
                             prefill_chunk_tokens=c.prefill_chunk_tokens
                             if prefill_chunk_tokens is None else prefill_chunk_tokens,
                             eos_id=self.cfg.eos_token_id, metrics=RecordingMetrics(),
                             prefix_cache_bytes=prefix_cache_mb << 20,
                             speculative_tokens=speculative_tokens,
                             inexact_speedups=inexact_speedups,
                             interleave_prefill=interleave_prefill)
        self.metrics = self.engine.metrics
        self.engine.start()

    def _request(self, prompt, n):
        from kvserve.model.sampling import SamplingParams
        from kvserve.server.domain import GenerateRequest, OutputParams, StopParams

        # (.tolist(): a 700-token numpy row as Python ints in ~20 us, where a comprehension
        # took ~150 us, ~0.4 ms right after an idle pause: inside the timed turn, ~7% of a
        # cached chat turn's time to first token on 6M; genai's runner takes the array as is)
        return GenerateRequest(prompt_ids=np.asarray(prompt, np.int64).tolist(),
                               sampling=SamplingParams(),
                               stopping=StopParams(max_new_tokens=n, ignore_eos=True),
                               output=OutputParams())

    def _submit_all(self, prompts, n):
        return self.engine.submit_many([self._request(p, n) for p in prompts])

    def generate(self, prompts, n):
        return self._collect(self._submit_all(prompts, n), n)

    @staticmethod
    def _collect(handles, n) -> np.ndarray:
        """Every handle's n tokens (B, n), in order; an early finish is an error."""
        from kvserve.server.domain import FinishEvent, TokenEvent

        out = np.zeros((len(handles), n), np.int64)
        for b, h in enumerate(handles):
            for ev in h:
                if isinstance(ev, TokenEvent):
                    out[b, ev.index] = ev.token_id
                elif isinstance(ev, FinishEvent) and ev.generated_tokens != n:
                    raise RuntimeError(f"engine finished early: {ev.reason} {ev.error}")
        return out

    def timed(self, prompts, n):
        """(tokens (B, n), seconds until every row had its first token (the engine's own
        clock: the rows' prefills may be spread over several iterations), seconds to the end),
        with the engine's counters over the call (cached prompt tokens, drafted / accepted)."""
        m = self.metrics
        before = (m.cached_tokens, m.drafted, m.accepted)
        first_step = len(m.steps)
        t0 = time.perf_counter()
        out = self._collect(self._submit_all(prompts, n), n)
        total = time.perf_counter() - t0
        first = m.last_first - t0
        self.counters = {k: v - v0 for k, v, v0 in zip(
            ("cached_tokens", "drafted", "accepted"),
            (m.cached_tokens, m.drafted, m.accepted), before)}
        # the model calls' seconds, and those at fewer rows than the call's batch (rows that
        # finished at different steps: speculation lets some run ahead)
        steps = m.steps[first_step:]
        self.counters["step_seconds"] = sum(s for _, s in steps)
        self.counters["short_batch_seconds"] = sum(s for b, s in steps if b < len(prompts))
        return out, first, total

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

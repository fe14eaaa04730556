"""What every benchmark runner shares: the ``Runner`` interface (``bench/runners.py`` says
what each operation measures), the fixed prompts, this process's RSS."""
from __future__ import annotations

import statistics
import time

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


def alternate(runners: dict, prompts_of, rounds: int, new: int) -> tuple[dict, dict]:
    """Each round every runner generates ``new`` tokens for ``prompts_of(round)`` (B, P) in
    turn, the order reversed every other round, after a 0.3 s pause each: (tok/s per round,
    the tokens (rounds, B, new)) per runner."""
    names = list(runners)
    tok_s, tokens = {k: [] for k in names}, {k: [] for k in names}
    for rnd in range(rounds):
        prompts = prompts_of(rnd)
        for k in (names if rnd % 2 == 0 else names[::-1]):
            time.sleep(0.3)
            t0 = time.perf_counter()
            tokens[k].append(runners[k].generate(prompts, new))
            tok_s[k].append(len(prompts) * new / (time.perf_counter() - t0))
    return tok_s, {k: np.stack(v) for k, v in tokens.items()}


class Runner:
    name = "?"
    has_steps = False
    has_score = False
    has_stream = False

    def generate(self, prompts: np.ndarray, n: int) -> np.ndarray:
        raise NotImplementedError

    def stream(self, prompt: np.ndarray, n: int) -> list[float]:
        raise NotImplementedError

    counters: dict = {}  # a runner's own counts over its last ``timed`` call

    def timed(self, prompts: np.ndarray, n: int) -> tuple[np.ndarray, float | None, float]:
        """(greedy tokens (B, n), seconds until every row had its first token (the prefill;
        None: not observable), seconds of the whole call)."""
        t0 = time.perf_counter()
        out = self.generate(np.asarray(prompts, np.int64), n)
        return out, None, time.perf_counter() - t0

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

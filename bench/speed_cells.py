"""The cells of the prefix cache and speculative decoding (issue 27), as one runner measures
them. Each takes a runner (``runner_base.Runner``: its ``timed(prompts, n)``) and returns a
JSON-able dict; ``bench/turns.py`` asks every runner of a cell in turn, and keeps each one's
best turn (and its turns by round, which the targets pair).

  prefix  two requests sharing ``shared`` tokens, each with ``tail`` tokens of its own: the
          first request's time to first token (nothing cached) and the second's (with a prefix
          cache: the shared tokens cached). A fresh shared prefix every repetition.
  chat    a chat replay: ``turns`` requests, each sending the whole history so far (the
          previous prompt, the runner's own greedy reply, a new user turn): per turn the time
          to first token and to the last token. A fresh conversation every repetition.
  spec    continuing fixed prompts (held-out code) ``n`` greedy tokens, ``batch`` at a time:
          tok/s over the whole calls and over the decode alone (after every row of a call
          had its first token: the prompts' prefill, which a prefix cache would shorten on
          repeats, left out), the drafted and accepted tokens, and a hash of the tokens
          (exactness: the same with speculation on and off).
"""
from __future__ import annotations

import hashlib
import time

import numpy as np

MAX_REPEATS = 5


def shared_prefix_pair(vocab: int, shared: int, tail: int, serial: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Two prompts (shared + tail,) that agree on their first ``shared`` tokens and differ in
    every one of the last ``tail``; ``serial`` picks a new shared prefix."""
    rng = np.random.default_rng([27, serial])
    common = rng.integers(2, vocab, size=shared, dtype=np.int64)
    a = rng.integers(2, vocab, size=tail, dtype=np.int64)
    b = 2 + (a - 2 + 1 + rng.integers(0, vocab - 3, size=tail)) % (vocab - 2)  # b != a
    return np.concatenate([common, a]), np.concatenate([common, b])


def next_chat_prompt(history: np.ndarray, reply: np.ndarray | None, user: np.ndarray
                     ) -> np.ndarray:
    """The next turn's whole prompt: the previous prompt, the reply to it, the new user turn."""
    parts = [history] + ([reply] if reply is not None else []) + [user]
    return np.concatenate(parts).astype(np.int64)


def chat_lengths(turns: int, first: int, user: int, reply: int) -> list[int]:
    """Prompt length of each turn (the first turn's prompt is ``first`` tokens)."""
    return [first + t * (reply + user) for t in range(turns)]


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000.0 * x


def prefix(r, vocab: int, shared: int, tail: int, serials, min_total: float = 1.0) -> dict:
    """Best (lowest) first- and second-request TTFT over repetitions (at least 2, more while
    the calls together took under ``min_total`` seconds, at most MAX_REPEATS)."""
    firsts, seconds, cached, total = [], [], [], 0.0
    while len(seconds) < 2 or (total < min_total and len(seconds) < MAX_REPEATS):
        a, b = shared_prefix_pair(vocab, shared, tail, next(serials))
        _, _, ta = r.timed(a[None], 1)  # TTFT = a one-token request, as the ttft cell
        _, _, tb = r.timed(b[None], 1)
        firsts.append(ta)
        seconds.append(tb)
        cached.append(r.counters.get("cached_tokens"))
        total += ta + tb
    return {"first_ms": _ms(min(firsts)), "second_ms": _ms(min(seconds)),
            "cached_tokens": cached[int(np.argmin(seconds))]}


def chat(r, vocab: int, turns: int, first: int, user: int, reply: int, serial: int) -> dict:
    """One conversation of ``turns`` turns (a fresh one per ``serial``)."""
    rng = np.random.default_rng([28, serial])
    prompt = rng.integers(2, vocab, size=first, dtype=np.int64)
    ttft, total, cached, lengths = [], [], [], []
    for t in range(turns):
        toks, ft, tt = r.timed(prompt[None], reply)
        ttft.append(_ms(ft if ft is not None else tt))
        total.append(_ms(tt))
        cached.append(r.counters.get("cached_tokens"))
        lengths.append(len(prompt))
        if t + 1 < turns:
            prompt = next_chat_prompt(prompt, toks[0], rng.integers(2, vocab, size=user,
                                                                    dtype=np.int64))
    return {"ttft_ms": ttft, "total_ms": total, "ttft_ms_sum": sum(ttft),
            "total_ms_sum": sum(total), "prompt_tokens": lengths, "cached_tokens": cached}


def spec(r, prompts: list[list[int]], batch: int, n: int) -> dict:
    """The prompts continued ``n`` tokens, ``batch`` at a time (equal-length prompts)."""
    seconds = decode_seconds = step_seconds = short_seconds = 0.0
    drafted = accepted = 0
    h = hashlib.sha256()
    for i in range(0, len(prompts), batch):
        rows = np.asarray(prompts[i:i + batch], np.int64)
        toks, first, tt = r.timed(rows, n)
        seconds += tt
        decode_seconds += tt - (first if first is not None else 0.0)
        drafted += r.counters.get("drafted") or 0
        accepted += r.counters.get("accepted") or 0
        step_seconds += r.counters.get("step_seconds") or 0.0
        short_seconds += r.counters.get("short_batch_seconds") or 0.0
        h.update(np.ascontiguousarray(toks, np.int64).tobytes())
    tokens = len(prompts) * n
    decode_tokens = len(prompts) * (n - 1)
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
            "decode_tok_s": decode_tokens / decode_seconds if decode_seconds > 0 else None,
            "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            # (the engine) the share of its model calls' seconds spent at fewer rows than the
            # batch: rows that finished early left the rest to run in a smaller batch
            "short_batch_share": short_seconds / step_seconds if step_seconds else None,
            "tokens_sha": h.hexdigest()[:16]}


def best_spec(r, prompts, batch: int, n: int, min_total: float = 1.0) -> dict:
    """``spec`` repeated while under ``min_total`` seconds (at most MAX_REPEATS): the best."""
    runs, total = [], 0.0
    t0 = time.perf_counter()
    while not runs or (total < min_total and len(runs) < MAX_REPEATS):
        runs.append(spec(r, prompts, batch, n))
        total = time.perf_counter() - t0
    best = max(runs, key=lambda x: x["decode_tok_s"] or x["tok_s"])
    if len({x["tokens_sha"] for x in runs}) > 1:
        best["tokens_sha"] = "varies"  # greedy decoding must repeat itself
    return best


# --- a runner's turns at a cell -> its entry in the results (used by bench/turns.py) ---------
BEST = {"prefix": ("second_ms", min), "chat": ("ttft_ms_sum", min),
        "spec": ("decode_tok_s", max)}
BY_ROUND = {"prefix": ("second_ms", "first_ms"), "chat": ("ttft_ms_sum", "total_ms_sum"),
            "spec": ("decode_tok_s", "tok_s")}


def by_round(got: list[dict], field: str, rounds: int) -> list[float | None]:
    """Each round's figure (None where the runner took no turn), trailing Nones dropped."""
    out: list[float | None] = [None] * rounds
    for t in got:
        out[t["round"]] = t.get(field)
    while out and out[-1] is None:
        out.pop()
    return out


def best_turns(key: tuple, got: list[dict], rounds: int) -> tuple[str, str, dict]:
    """(group, name, entry): e.g. ("prefix", "1000+16", the best turn with ``turns_<field>``
    lists by round; a prefix cell's first request the best of its own turns). A spec cell
    whose turns made different tokens says ``varies``."""
    op = key[0]
    field, pick = BEST[op]
    best = dict(pick(got, key=lambda t: t.get(field) or 0.0))
    best.pop("round", None)
    for f in BY_ROUND[op]:
        best[f"turns_{f}"] = by_round(got, f, rounds)
    if op == "prefix":  # two requests timed apart: each its own best (a chat's sums stay one
        # conversation's)
        best["first_ms"] = min(t["first_ms"] for t in got)
    if op == "spec" and len({t.get("tokens_sha") for t in got}) > 1:
        best["tokens_sha"] = "varies"
    name = f"{key[1]}+{key[2]}" if op == "prefix" else str(key[1])
    return op, name, best

"""Sampling as pure numpy functions, shared by the torch reference and the server (no torch).

Order of operations for one row of logits (V,):
  penalties (repetition, presence, frequency) -> greedy argmax if temperature == 0
  -> temperature -> top-k -> top-p -> min-p -> draw.

Seed rule (so that any two implementations agree): the token a sampled step chooses at output
position k (the request's k-th generated token, from 0) is the Gumbel-max draw

    argmax over v of  x[v] - log(-log(u[v]))     (ties: the lowest id)

over the step's scaled, filtered logits x (removed tokens at -inf), where u are V uniforms
that depend on the seed and k alone (``position_uniforms``): u[v] = (w[v] >> 11) / 2^53, w the
64-bit output words of Philox4x64-10 under the key (seed mod 2^64, (seed >> 64) mod 2^64),
its counter blocks (1, k, 0, 0), (2, k, 0, 0), ... (numpy's ``Philox(key=..., counter=(0, k,
0, 0)).random_raw(V)``: the counter is incremented before each block of 4 words). Greedy steps
draw nothing; a request without a seed gets a random one of its own (``request_seed``).

It is an exact draw from softmax(x), and a function of (seed, k, logits) with no generator
state, so a speculative verification, a resumed stream or any batch makes the draws the plain
path makes; a token changes only where the two best perturbed scores are within the logits'
rounding. The inverse-CDF rule it replaced (one ``PCG64(seed)`` uniform a step over the tokens
sorted by probability) changed 0.05-4.4% of draws when the logits moved by 1e-6 of their
largest (4k-152k tokens), this one none of 2,000 a setting (``tests/model/test_sampling.py``
keeps 500 a setting at 4k and 32k); its moves grow with the perturbation (~0.4% of draws at
1e-3). The draw needs no sort: 2-4x faster than the old one at 4k-152k tokens (measured on
the 2-core bench machines); top-p orders only the most likely tokens (``top_p_prefix``).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

NEG_INF = np.float32(-np.inf)
_U64 = (1 << 64) - 1
# A temperature below this is greedy (vLLM's rule too): dividing float32 logits by ~1e-38 and
# less overflows to inf, and inf - inf made the sampled token garbage (NaN probabilities),
# while any temperature this small draws the argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_BELOW_TEMPERATURE (e.g. 0) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off (HF rule: divide positive logits, multiply negative)
    presence_penalty: float = 0.0  # OpenAI rule, over generated tokens
    frequency_penalty: float = 0.0  # OpenAI rule, over generated tokens
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def request_seed(seed: int | None) -> int:
    """The seed a sampled request draws with: its own, else a fresh random one."""
    return int(seed) if seed is not None else secrets.randbits(64)


def position_uniforms(seed: int, position: int, n: int) -> np.ndarray:
    """The ``n`` uniforms in [0, 1) of output position ``position`` under ``seed`` (the seed
    rule; each position its own Philox counter block, so positions never share a stream)."""
    key = np.array([seed & _U64, (seed >> 64) & _U64], np.uint64)
    counter = np.array([0, position & _U64, 0, 0], np.uint64)
    words = np.random.Philox(key=key, counter=counter).random_raw(n)
    return (words >> np.uint64(11)) * (1.0 / (1 << 53))  # (Generator.random's doubles)


def apply_penalties(logits: np.ndarray, context_ids: np.ndarray, generated_ids: np.ndarray,
                    p: SamplingParams) -> np.ndarray:
    """logits (V,) float32; context_ids: prompt + generated; generated_ids: generated only."""
    if not p.has_penalties:
        return logits
    out = logits.astype(np.float32, copy=True)
    if p.repetition_penalty != 1.0 and context_ids.size:
        seen = np.unique(context_ids)
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and generated_ids.size:
        ids, counts = np.unique(generated_ids, return_counts=True)
        out[ids] -= p.presence_penalty + p.frequency_penalty * counts.astype(np.float32)
    return out


def filter_logits(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature, top-k, top-p, min-p. Returns scaled logits with removed tokens at -inf."""
    x = logits.astype(np.float32) / np.float32(p.temperature)
    V = x.shape[-1]
    if 0 < p.top_k < V:
        kth = np.partition(x, V - p.top_k)[V - p.top_k]
        x = np.where(x < kth, NEG_INF, x)
    if p.top_p < 1.0 or p.min_p > 0.0:
        probs = softmax(x)
        if p.top_p < 1.0:
            keep = top_p_prefix(probs, p.top_p)
            kept = np.full_like(x, NEG_INF)
            kept[keep] = x[keep]
            x = kept
        if p.min_p > 0.0:
            x = np.where(probs < p.min_p * probs.max(), NEG_INF, x)
    return x


_TOP_P_FIRST = 1024  # tokens ordered first for top-p (most distributions reach p within them)


def top_p_prefix(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest prefix of the tokens by descending probability (ties by ascending id) whose
    mass reaches ``top_p`` (always at least one token). The same ids as ordering the whole
    vocabulary (``sorted_order``), which at 152k tokens took ~20 ms a draw: the tokens at or
    above the m-th largest probability (ties included) are the order's first ones, so they are
    ordered alone, m = 1,024 then 8x more until their mass reaches ``top_p``; their float32
    running sum is the whole order's, term for term."""
    V = probs.shape[-1]
    target = np.float32(top_p)
    m = _TOP_P_FIRST
    while True:
        if m < V:
            at_least = np.partition(probs, V - m)[V - m]  # the m-th largest probability
            ids = np.flatnonzero(probs >= at_least)
            order = ids[np.lexsort((ids, -probs[ids]))]  # by descending p, then ascending id
        else:
            order = sorted_order(probs)
        cum = np.cumsum(probs[order])
        if m >= V or cum[-1] >= target:
            return order[:int(np.searchsorted(cum, target, side="left")) + 1]
        m *= 8


def softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def sorted_order(probs: np.ndarray) -> np.ndarray:
    """Indices by descending probability, ties by ascending id (stable sort of -p)."""
    return np.argsort(-probs, kind="stable")


def draw(x: np.ndarray, seed: int, position: int) -> int:
    """The seed rule's Gumbel-max draw from scaled, filtered logits ``x`` (V,) (-inf: removed)
    at output position ``position``."""
    u = position_uniforms(seed, position, x.shape[-1])
    with np.errstate(divide="ignore", invalid="ignore"):  # (u = 0: that token's score is -inf)
        scores = x.astype(np.float64) - np.log(-np.log(u))  # (removed tokens stay -inf)
    return int(np.argmax(scores))  # (all removed: 0, as a greedy argmax of -inf)


def next_token(logits: np.ndarray, p: SamplingParams, seed: int | None, position: int,
               context_ids: np.ndarray, generated_ids: np.ndarray) -> int:
    """One step for one row: logits (V,) -> token id. ``seed``: the request's (``request_seed``;
    unused when greedy); ``position``: the index of the token being chosen in its output."""
    x = apply_penalties(logits, context_ids, generated_ids, p)
    if p.greedy:
        return int(np.argmax(x))
    return draw(filter_logits(x, p), request_seed(seed), position)


def token_logprobs(logits: np.ndarray, tok: int, n_top: int
                   ) -> tuple[float, np.ndarray | None, np.ndarray | None]:
    """The chosen token's logprob and, when ``n_top``, the top ids and logprobs. logits (V,)."""
    lp = log_softmax(logits)
    if not n_top:
        return float(lp[tok]), None, None
    ids, lps = top_n(lp, n_top)
    return float(lp[tok]), ids, lps


def top_n(logprobs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n most likely ids and their logprobs, by descending logprob, equal ones by
    ascending id (also across the cut: the first n of ``top_n(lp, m)`` for m > n are
    ``top_n(lp, n)``, which a Score served from kept top tokens relies on). logprobs: (V,)."""
    V = logprobs.shape[-1]
    n = min(n, V)
    if n < V:
        part = np.argpartition(-logprobs, n)
        idx, cut = part[:n], logprobs[part[n]]
        if logprobs[idx].min() == cut:  # ties across the cut: the lowest ids among them
            above = np.flatnonzero(logprobs > cut)
            idx = np.concatenate([above, np.flatnonzero(logprobs == cut)[:n - len(above)]])
    else:
        idx = np.arange(V)
    idx = idx[np.lexsort((idx, -logprobs[idx]))]
    return idx, logprobs[idx]

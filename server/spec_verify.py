"""Exact verification of a speculative draft, for greedy and for (seeded) sampling.

A verification call feeds a sequence its last sampled token followed by its draft
d_0 .. d_{K-1} and returns logits rows r_0 .. r_K: row j is the row the plain path would
compute after the sequence's tokens so far plus d_0 .. d_{j-1} (teacher forcing,
``FusedLM.verify``), up to floating-point rounding (the multi-token queries' attention rounds
differently: up to 6.5e-7 of the largest logit on the export matrix). ``verify_row`` then
walks the rows in order and, at each position, samples the token *the plain path would sample
there*, with the engine's own per-step function
(banned ids, penalties over the context so far — accepted draft tokens included — and
``model.sampling.next_token`` with the sequence's seed at the token's position):

    for j = 0 .. K:   t_j = sample(j, r_j);  emit t_j;  stop unless j < K and t_j == d_j

Why the output is the plain path's, token for token. By induction on j: while every emitted
token equals the draft token fed after it, row j's context is the plain path's context at that
step, so ``sample`` sees the plain path's logits, penalties and banned ids, and — because
a sampled draw is a function of the seed and the token's position alone (no generator state)
— the plain path's noise; so t_j is the plain path's token. The walk stops at the first
t_j != d_j (that token is the correction, the plain path's token too) or after the bonus token
t_K; no row after the stop is used. Hence greedy and seeded outputs are the same with and
without speculation, and the next step continues identically, as far as the rows agree: two
candidates closer than that rounding (a greedy near-tie; for a seeded draw, two tokens whose
Gumbel-perturbed scores are that close) may resolve the other way (docs/speed.md measures how
often).

Why this is speculative rejection sampling (the output distribution is unchanged). For a
deterministic draft (n-gram lookup: q(d_j) = 1), Leviathan et al.'s rule accepts d_j with
probability min(1, p(d_j) / q(d_j)) = p(d_j) and on rejection samples from
norm(max(0, p - q)) = p with d_j removed, renormalised. Here t_j ~ p (a Gumbel-max draw),
so P(accept) = P(t_j = d_j) = p(d_j), and given rejection (t_j != d_j) t_j has probability
p(y) / (1 - p(d_j)) for y != d_j: exactly that distribution. Each position uses its own
noise, as the plain path does. (``tests/server/test_spec_verify.py`` checks
both identities and the statistics.)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

# sample(j, logits_row) -> token: the plain path's sampling for the row at draft position j
Sampler = Callable[[int, np.ndarray], int]


def verify_row(logits: np.ndarray, draft: Sequence[int], sample: Sampler,
               done: Callable[[int], bool] | None = None) -> list[int]:
    """The tokens a verification yields for one sequence: the accepted draft tokens followed
    by one correction (first mismatch) or bonus (all accepted) token, i.e. 1 .. K + 1 tokens;
    the number of accepted draft tokens is ``len(result) - 1`` unless ``done`` stopped it.

    ``logits``: (S, V) with S >= len(draft) + 1 (rows past that are ignored). ``sample`` is
    called once per emitted token, in order, with j = 0, 1, ...; the engine appends each token
    to the sequence's context inside it (or between calls) so that penalties at j + 1 see it.
    ``done(token)``: True when the sequence finishes with that token (eos, a stop id or string,
    max_new_tokens): the walk stops there, as the plain path would (no later row is sampled).
    """
    K = len(draft)
    if logits.shape[0] < K + 1:
        raise ValueError(f"{logits.shape[0]} logits rows for a draft of {K} tokens")
    out: list[int] = []
    for j in range(K + 1):
        tok = int(sample(j, logits[j]))
        out.append(tok)
        if j == K or tok != draft[j] or (done is not None and done(tok)):
            break
    return out


def accepted_count(draft: Sequence[int], emitted: Sequence[int]) -> int:
    """How many draft tokens ``emitted`` (a ``verify_row`` result) accepted (metrics): the
    leading emitted tokens equal to the draft's. The sequence's KV rows to keep after the call
    are its rows before it plus ``len(emitted)`` (the fed last token and the accepted draft
    tokens; the last emitted token is fed by the next step)."""
    n = 0
    for d, t in zip(draft, emitted):
        if d != t:
            break
        n += 1
    return n

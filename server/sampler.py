"""Sampling: one row of logits -> the sequence's next token, with the request's own
``SamplingParams`` (``model.sampling``'s pure functions). Ids that may not end the sequence yet
(``stopping.banned_ids``) are masked first; penalties see the prompt and the tokens generated
so far. A sampled step draws by the seed rule of ``model.sampling``: from the request's seed
and the token's position alone, as ``model.generate`` does, so its output does not depend on
the batch it shares, nor on whether the step was a verification.

This is the one place a token is chosen from logits: logits processors (masks, constraints)
go here, before ``next_token``; the batch's plain greedy rows take one argmax for the whole
batch instead (``stopping.argmax_from`` says when that is the same token).
"""
from __future__ import annotations

import numpy as np

from kvserve.model.sampling import SamplingParams, next_token

from .domain import GenerateRequest
from .stopping import banned_ids

NEG_INF = np.float32(-np.inf)
_NO_TOKENS = np.zeros(0, np.int64)


def masked(raw: np.ndarray, req: GenerateRequest) -> np.ndarray:
    """``raw`` with what the request's constraint does not allow at -inf (a copy; ``raw``
    itself when unconstrained). Logprobs of a constrained request are of this distribution."""
    if req.constraint is None:
        return raw
    x = raw.copy()
    req.constraint.apply(x)
    return x


def sample_row(raw: np.ndarray, req: GenerateRequest, generated: list[int],
               seed: int | None, eos_ids: frozenset[int]) -> int:
    """The token chosen from ``raw`` (V,) after ``generated`` (the request's tokens so far;
    the new one's position is their count). ``seed``: the sequence's (None: greedy). ``raw``
    is not modified."""
    x = raw
    banned = banned_ids(req.stopping, eos_ids, len(generated))
    if banned:
        x = raw.copy()
        x[banned] = NEG_INF
        if req.constraint is not None and not np.isfinite(x).any():
            x = raw  # the constraint allows only an end token here: the constraint wins
    p: SamplingParams = req.sampling
    if p.has_penalties:  # the token arrays are built only when used
        gen = np.asarray(generated, np.int64)
        ctx = np.concatenate([np.asarray(req.prompt_ids, np.int64), gen])
    else:
        gen = ctx = _NO_TOKENS
    return next_token(x, p, seed, len(generated), ctx, gen)

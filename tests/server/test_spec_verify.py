"""Exact verification (``kvserve.server.spec_verify``): (a) the speculative walk emits the plain
path's tokens — greedy, seeded sampling with
top-k/top-p/min-p, penalties, banned ids — over many random models, seeds and drafts; (b) the
acceptance of a drafted token x happens with probability p(x) and the token after a rejection
follows p without x, renormalised (binomial / chi-square bounds stated below)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvserve.model.sampling import NEG_INF, SamplingParams, filter_logits, next_token, softmax
from kvserve.server.spec_verify import accepted_count, verify_row

V = 40


def model_logits(context: list[int]) -> np.ndarray:
    """A deterministic 'model': logits (V,) from a hash of the whole context, peaked so that
    drafts copied from earlier output are often right."""
    h = hashlib.blake2b(np.asarray(context, np.int64).tobytes(), digest_size=8).digest()
    g = np.random.default_rng(int.from_bytes(h, "little"))
    x = g.normal(0, 1, V).astype(np.float32)
    x[g.integers(V)] += 4.0
    return x


class Seq:
    """The engine's per-sequence sampling state, as the plain path uses it."""

    def __init__(self, prompt, params: SamplingParams, min_new: int, banned: list[int]):
        self.prompt, self.p, self.min_new, self.banned = list(prompt), params, min_new, banned
        self.generated: list[int] = []

    def sample(self, raw: np.ndarray) -> int:
        x = raw
        if len(self.generated) < self.min_new:
            x = raw.copy()
            x[self.banned] = NEG_INF
        gen = np.asarray(self.generated, np.int64)
        ctx = np.asarray(self.prompt + self.generated, np.int64)
        tok = next_token(x, self.p, self.p.seed, len(self.generated), ctx, gen)
        self.generated.append(tok)
        return tok


def plain(prompt, params, n, min_new=0, banned=()):
    s = Seq(prompt, params, min_new, list(banned))
    for _ in range(n):
        s.sample(model_logits(s.prompt + s.generated))
    return s


def speculative(prompt, params, n, draft_rng, min_new=0, banned=()):
    """Drafts of random length, each token copied from the plain continuation's likely
    region or random; verified with teacher-forced logits; stops after n tokens."""
    s = Seq(prompt, params, min_new, list(banned))
    drafted = accepted = 0
    while len(s.generated) < n:
        ctx = s.prompt + s.generated
        K = int(draft_rng.integers(0, 6))
        draft = []
        for _ in range(K):  # half the time the model's argmax (often accepted), else random
            row = model_logits(ctx + draft)
            draft.append(int(np.argmax(row)) if draft_rng.random() < 0.6
                         else int(draft_rng.integers(V)))
        rows = np.stack([model_logits(ctx + draft[:j]) for j in range(K + 1)])
        left = n - len(s.generated)
        emitted = verify_row(rows, draft, lambda j, row: s.sample(row),
                             done=lambda tok: len(s.generated) >= n)
        assert 1 <= len(emitted) <= min(K + 1, left)
        assert s.generated[-len(emitted):] == emitted
        drafted += K
        accepted += accepted_count(draft, emitted)
    return s, drafted, accepted


PARAMS = [
    SamplingParams(),  # greedy
    SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=1.2, top_k=10, top_p=0.9, seed=12),
    SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.2,
                   frequency_penalty=0.3, seed=13),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "greedy-penalties", "seeded",
                                                "seeded-topk-topp", "seeded-minp-penalties"])
def test_identical_to_the_plain_path(params):
    """40 random prompts x 30 tokens each (and banned ids before token 3, as min_new_tokens
    does): the same tokens."""
    g = np.random.default_rng(3)
    total_drafted = total_accepted = 0
    for trial in range(40):
        prompt = g.integers(0, V, int(g.integers(1, 12))).tolist()
        p = params if params.seed is None else \
            SamplingParams(**{**params.__dict__, "seed": params.seed * 1000 + trial})
        want = plain(prompt, p, 30, min_new=3, banned=[0, 1])
        got, d, a = speculative(prompt, p, 30, np.random.default_rng(trial), min_new=3,
                                banned=[0, 1])
        assert got.generated == want.generated, trial
        total_drafted += d
        total_accepted += a
    assert total_drafted > 1000 and 0 < total_accepted < total_drafted
    print(f"{params}: accepted {total_accepted}/{total_drafted} draft tokens")


def test_a_full_acceptance_adds_the_bonus_token():
    ctx = [1, 2, 3]
    draft = []
    for _ in range(4):
        draft.append(int(np.argmax(model_logits(ctx + draft))))
    rows = np.stack([model_logits(ctx + draft[:j]) for j in range(5)])
    s = Seq(ctx, SamplingParams(), 0, [])
    out = verify_row(rows, draft, lambda j, row: s.sample(row))
    assert out[:4] == draft and len(out) == 5 and accepted_count(draft, out) == 4
    assert out[4] == int(np.argmax(model_logits(ctx + draft)))


def test_too_few_rows_is_refused():
    with pytest.raises(ValueError, match="2 logits rows for a draft of 2"):
        verify_row(np.zeros((2, V), np.float32), [1, 2], lambda j, row: 0)


def test_acceptance_rate_is_p_of_the_draft_and_rejections_follow_p_without_it():
    """One logits row, temperature 0.9 with top-p 0.95, a drafted token x (the second most likely, p(x) = 0.13):
    N = 20,000 seeded verifications. The acceptance frequency is within 4.5 binomial standard
    deviations of p(x) (~0.015 here); after a rejection, the token frequencies match
    p(y) / (1 - p(x)) by a chi-square test over the tokens with expected count >= 5 (the
    statistic below the 0.999 quantile of its distribution, computed here by Wilson-Hilferty)."""
    g = np.random.default_rng(0)
    raw = g.normal(0, 1.5, V).astype(np.float32)
    params_base = dict(temperature=0.9, top_p=0.95)
    probs = softmax(filter_logits(raw, SamplingParams(**params_base)))
    x = int(np.argsort(-probs)[1])  # the second most likely token
    px = float(probs[x])
    N = 20_000
    accepted = 0
    counts = np.zeros(V, np.int64)
    for i in range(N):
        p = SamplingParams(**params_base, seed=i)
        ctx = np.zeros(0, np.int64)
        out = verify_row(raw[None].repeat(2, 0), [x],
                         lambda j, row: next_token(row, p, p.seed, j, ctx, ctx))
        if out[0] == x:
            accepted += 1
        else:
            counts[out[0]] += 1
    rate = accepted / N
    sd = (px * (1 - px) / N) ** 0.5
    assert abs(rate - px) <= 4.5 * sd, (rate, px, sd)
    rejected = N - accepted
    want = probs.astype(np.float64).copy()
    want[x] = 0
    want /= want.sum()
    expected = want * rejected
    ok = expected >= 5
    assert counts[want == 0].sum() == 0  # x itself and the tokens top-p removed: never
    chi2 = float((((counts[ok] - expected[ok]) ** 2) / expected[ok]).sum())
    dof = int(ok.sum()) - 1
    z = 3.09  # the 0.999 normal quantile; Wilson-Hilferty chi-square quantile
    limit = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 <= limit, (chi2, limit, dof)
    print(f"p(x)={px:.4f} accept rate={rate:.4f} (sd {sd:.4f}); "
          f"chi2={chi2:.1f} <= {limit:.1f} (dof {dof})")

"""The prefix cache and speculative decoding inside the engine, on the tiny fused artifact:
exact. Greedy and seeded outputs are token-identical with each feature on and off (alone and
in shared batches, woken per token and staged), the logits a verification or a restored
prefix yields are the plain path's within 1e-4, and both features actually engage (cache
hits, accepted drafts)."""
from __future__ import annotations

import numpy as np
import pytest

from kvserve.model.sampling import SamplingParams
from kvserve.server.detok import TokenBytes
from kvserve.server.domain import GenerateRequest, OutputParams, StopParams, TokenEvent
from kvserve.server.engine import Engine

LOGIT_TOL = 1e-4
SHARED = [(7 * i) % 300 + 5 for i in range(40)]  # a 40-token prefix (two full blocks)
PROMPTS = [
    [11, 12, 13, 14] * 6,  # repeats itself: n-gram drafts from the prompt
    SHARED + [21, 22, 23],
    SHARED + [31, 32],
    [40, 41, 42, 43, 44, 40, 41, 42],
    SHARED + [21, 22, 23, 24, 25],
    list(range(50, 90)),
]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
COLD = SamplingParams(temperature=0.2, seed=5)  # sampled, yet loops like greedy: drafts hit
PENALISED = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                           seed=7)


@pytest.fixture(scope="module")
def lm(artifact):
    from kvserve.artifact.loader import load_lm
    return load_lm(artifact.dir, provider="cpu", threads=1, attention=False)


def _engine(lm, prefix_mb: int, spec: int, stream_interval: float = 0.0) -> Engine:
    V = lm.cfg.vocab_size
    e = Engine(lm, TokenBytes.without_text(V), max_batch=4, max_queue=16,
               score_chunk_floats=64 * V, eos_id=None, prefix_cache_bytes=prefix_mb << 20,
               speculative_tokens=spec, stream_interval=stream_interval)
    e.start()
    return e


def _requests(sampling: SamplingParams, n: int = 24, logits: bool = False):
    return [GenerateRequest(list(p), SamplingParams(**{**sampling.__dict__,
                                                       "seed": None if sampling.seed is None
                                                       else sampling.seed + i}),
                            StopParams(max_new_tokens=n, ignore_eos=True),
                            OutputParams(return_logits=logits))
            for i, p in enumerate(PROMPTS)]


def _run(engine: Engine, reqs) -> list[list[TokenEvent]]:
    handles = engine.submit_many(reqs)
    return [[e for e in h if isinstance(e, TokenEvent)] for h in handles]


def _tokens(runs) -> list[list[int]]:
    return [[e.token_id for e in events] for events in runs]


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED, COLD, PENALISED],
                         ids=["greedy", "seeded", "seeded-cold", "penalties"])
def test_outputs_identical_with_each_feature_on_and_off(lm, sampling):
    engines = {k: _engine(lm, *k) for k in [(0, 0), (64, 0), (0, 4), (64, 4)]}
    try:
        runs = {k: [_tokens(_run(e, _requests(sampling))) for _ in range(2)]
                for k, e in engines.items()}  # the second round meets a warm cache
        base = runs[(0, 0)][0]
        for k, rounds in runs.items():
            for r in rounds:
                assert r == base, f"prefix/spec {k}: outputs differ from the plain path"
        assert engines[(64, 0)].prefix.cached_blocks > 0
        both = engines[(64, 4)]
        if sampling.temperature < 0.5:  # a random model's (near-)greedy output loops
            assert both.spec.accepted > 0
    finally:
        for e in engines.values():
            e.stop()


def test_teacher_forced_logits_through_verification_and_cached_prefixes(lm):
    plain, fast = _engine(lm, 0, 0), _engine(lm, 64, 4)
    try:
        want = _run(plain, _requests(SamplingParams(), logits=True))
        for _ in range(2):
            got = _run(fast, _requests(SamplingParams(), logits=True))
            worst = max(float(np.abs(a.logits - b.logits).max())
                        for ra, rb in zip(want, got) for a, b in zip(ra, rb))
            assert [e.token_id for r in got for e in r] == [e.token_id for r in want for e in r]
            assert worst <= LOGIT_TOL, f"max |dlogit| {worst:.3g}"
        assert fast.spec.accepted > 0 and fast.prefix.cached_blocks > 0
    finally:
        plain.stop()
        fast.stop()


def test_staged_callers_take_the_lean_path_through_verification(lm):
    """Streaming callers woken in rounds (their plain greedy tokens held, made into events
    later) get the same tokens and indices with speculation."""
    plain, fast = _engine(lm, 0, 0, 0.05), _engine(lm, 64, 4, 0.05)
    try:
        want = _run(plain, _requests(SamplingParams(), n=40))
        got = _run(fast, _requests(SamplingParams(), n=40))
        assert _tokens(got) == _tokens(want)
        for events in got:
            assert [e.index for e in events] == list(range(40))
        assert fast.spec.accepted > 0
    finally:
        plain.stop()
        fast.stop()


def test_a_stop_id_inside_an_accepted_draft_ends_the_staged_stream_where_plain_does(lm):
    """A held (quiet) row whose verified tokens hold a stop id, or reach max_new_tokens, is
    walked token by token: it ends at the same token as the plain path."""
    plain, fast = _engine(lm, 0, 0, 0.05), _engine(lm, 0, 4, 0.05)
    try:
        loose = _tokens(_run(plain, _requests(SamplingParams(), n=40)))
        reqs = _requests(SamplingParams(), n=37)
        for r, toks in zip(reqs, loose):
            r.stopping = StopParams(max_new_tokens=37, ignore_eos=True,
                                    stop_token_ids=(toks[25],))
        want = _tokens(_run(plain, reqs))
        got = _tokens(_run(fast, reqs))
        assert got == want
        assert all(len(t) <= 37 for t in got) and any(len(t) < 37 for t in got)
        assert fast.spec.accepted > 0
    finally:
        plain.stop()
        fast.stop()


def test_shared_prefix_admitted_together_is_computed_once(lm):
    """Three requests with the same 40-token prefix arrive together: the first prefills it,
    the others restore its two blocks (32 tokens) from the cache."""
    e = _engine(lm, 64, 0)
    try:
        reqs = [GenerateRequest(SHARED + tail, SamplingParams(), StopParams(max_new_tokens=4),
                                OutputParams()) for tail in ([1, 2], [3, 4, 5], [6])]
        seen = []
        orig = e.runner._prefill_cached

        def spy(seq):
            orig(seq)
            seen.append(seq.cached_tokens)
        e.runner._prefill_cached = spy
        _run(e, reqs)
        assert seen == [32, 32]
    finally:
        e.stop()

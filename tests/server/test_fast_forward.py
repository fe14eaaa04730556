"""Fast-forward of the tokens a constraint forces (server/fast_forward.py) inside the engine, on
the tiny fused artifact with real onnxruntime and llguidance: exact. Greedy, seeded and
penalised outputs of JSON-schema, regex and choice rows (alone and sharing a batch with free
rows) are token-identical with fast-forward on and off; it actually saves model calls and
counts its tokens; the logprobs of forced tokens are the plain path's; a resumed seeded stream
continues identically (one uniform per emitted token, forced or not)."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from kvserve_testing import fail_iteration
from tokenizers import Tokenizer as HFTokenizer

from kvserve.model.sampling import SamplingParams
from kvserve.server.constraints import ConstraintSpec
from kvserve.server.detok import TokenBytes
from kvserve.server.domain import (FinishEvent, GenerateRequest, OutputParams, StopParams,
                                   TokenEvent)
from kvserve.server.engine import Engine
from kvserve.server.guides import Guides
from kvserve.server.metrics import Metrics

pytest.importorskip("llguidance")

# fixed keys, all required, no other: long forced runs ({"first_name_of_the_person":" ...)
SCHEMA = {"type": "object", "properties": {
    "first_name_of_the_person": {"type": "string", "maxLength": 6},
    "the_age_in_years": {"type": "integer", "minimum": 0, "maximum": 99},
    "is_currently_active": {"type": "boolean"}},
    "required": ["first_name_of_the_person", "the_age_in_years", "is_currently_active"],
    "additionalProperties": False}
REGEX = r"id-(alpha|beta)-[0-9]{2}-done"
CHOICES = ["the quick brown fox", "the lazy dog", "a slow green turtle"]
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
PENALISED = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                           seed=7)
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def lm(artifact):
    from kvserve.artifact.loader import load_lm
    return load_lm(artifact.dir, provider="cpu", threads=1, attention=False)


@pytest.fixture(scope="module")
def guides(artifact, lm):
    return Guides(artifact.tokenizer.to_str(), lm.cfg.vocab_size, [artifact.tokenizer.eos_id])


def _engine(lm, artifact, ff: bool, spec: int = 0, metrics=None) -> Engine:
    V = lm.cfg.vocab_size
    tb = TokenBytes(HFTokenizer.from_file(str(artifact.dir / "tokenizer.json")), V)
    e = Engine(lm, tb, max_batch=8, max_queue=16, score_chunk_floats=64 * V,
               eos_id=artifact.tokenizer.eos_id, speculative_tokens=spec, fast_forward=ff,
               metrics=metrics)
    e.start()
    return e


def _req(guides, spec, sampling, i=0, out=OutputParams(), max_new=160, resume=()):
    s = SamplingParams(**{**sampling.__dict__,
                          "seed": None if sampling.seed is None else sampling.seed + i})
    return GenerateRequest([5 + i, 17, 42, 99, 7], s, StopParams(max_new_tokens=max_new),
                           out, resume=tuple(resume), constraint=guides.constraint(spec))


def _mixed(guides, sampling, out=OutputParams()):
    """Constrained and free rows in one batch."""
    specs = [ConstraintSpec.json_schema(SCHEMA), None, ConstraintSpec.regex(REGEX),
             ConstraintSpec.choice(CHOICES), None, ConstraintSpec.json_schema(SCHEMA)]
    return [_req(guides, s, sampling, i, out) for i, s in enumerate(specs)]


def _run(engine: Engine, reqs):
    """(token events, finish event) per request."""
    out = []
    for h in engine.submit_many(reqs):
        evs = list(h)
        out.append(([e for e in evs if isinstance(e, TokenEvent)],
                    next(e for e in evs if isinstance(e, FinishEvent))))
    return out


def _ids(runs):
    return [[e.token_id for e in toks] for toks, _ in runs]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, PENALISED],
                         ids=["greedy", "seeded", "penalties"])
def test_outputs_identical_with_fast_forward_on_and_off(lm, artifact, guides, sampling):
    engines = {k: _engine(lm, artifact, *k) for k in [(False, 0), (True, 0), (True, 4)]}
    try:
        runs = {k: _run(e, _mixed(guides, sampling)) for k, e in engines.items()}
        base = runs[(False, 0)]
        for k, r in runs.items():
            assert _ids(r) == _ids(base), f"fast-forward, speculation {k}: outputs differ"
        for i in (0, 2, 3, 5):  # every constraint held (a random model: only the mask)
            assert base[i][1].reason.value in ("constraint", "eos_token"), base[i][1]
        for i in (0, 5):
            jsonschema.validate(json.loads(base[i][1].text), SCHEMA)
        assert re.fullmatch(REGEX, base[2][1].text), base[2][1].text
        assert base[3][1].text in CHOICES
        for k in [(True, 0), (True, 4)]:
            assert engines[k].fast_forward.accepted > 0, k
        assert engines[(False, 0)].fast_forward is None
    finally:
        for e in engines.values():
            e.stop()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["schema", "regex", "choice", "grammar"])
def test_each_kind_alone_is_identical_on_and_off(lm, artifact, guides, kind, sampling):
    spec = {"schema": ConstraintSpec.json_schema(SCHEMA), "regex": ConstraintSpec.regex(REGEX),
            "choice": ConstraintSpec.choice(CHOICES),
            "grammar": ConstraintSpec.lark('start: "point(" NUM ", " NUM ")"\n'
                                           'NUM: /[0-9]{1,3}/')}[kind]
    on, off = _engine(lm, artifact, True), _engine(lm, artifact, False)
    try:
        got = _run(on, [_req(guides, spec, sampling, 3)])
        want = _run(off, [_req(guides, spec, sampling, 3)])
        assert _ids(got) == _ids(want)
        assert got[0][1].text == want[0][1].text
        assert got[0][1].reason.value in ("constraint", "eos_token"), got[0][1]
        assert on.fast_forward.accepted > 0
        assert on.steps < off.steps
    finally:
        on.stop()
        off.stop()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_wrong_forced_drafts_are_rejected_exactly(lm, artifact, guides, sampling):
    """A draft token the plain path would not pick (with a real tokenizer: another tokenization
    of the forced text) is rejected like a wrong n-gram draft, and nothing of it reaches the
    matcher: here every forced draft of 2+ tokens has its middle token replaced."""
    on, off = _engine(lm, artifact, True), _engine(lm, artifact, False)
    real = on.fast_forward.forced
    V = lm.cfg.vocab_size

    def corrupt(seq):
        d = list(real(seq))
        if len(d) >= 2:
            d[len(d) // 2] = (d[len(d) // 2] + 1) % V
        return d

    on.fast_forward.forced = corrupt
    try:
        got = _run(on, _mixed(guides, sampling))
        want = _run(off, _mixed(guides, sampling))
        assert _ids(got) == _ids(want)
        ff = on.fast_forward
        assert 0 < ff.accepted < ff.drafted  # accepted up to the wrong token, then corrected
    finally:
        on.stop()
        off.stop()


def test_fast_forward_saves_model_calls_and_counts_its_tokens(lm, artifact, guides):
    """One JSON-schema row, greedy, speculation off: the forced keys go in verification calls
    (batch 1: the whole forced run at once), so fewer model calls yield the same tokens."""
    metrics = Metrics()
    on, off = _engine(lm, artifact, True, metrics=metrics), _engine(lm, artifact, False)
    try:
        spec = ConstraintSpec.json_schema(SCHEMA)
        got = _run(on, [_req(guides, spec, GREEDY)])
        want = _run(off, [_req(guides, spec, GREEDY)])
        assert _ids(got) == _ids(want)
        n = len(got[0][0])
        jsonschema.validate(json.loads(got[0][1].text), SCHEMA)
        forced = metrics.forced_tokens.get()
        assert forced == on.fast_forward.accepted >= 20, forced  # the keys alone: 29+ tokens
        assert off.steps == n - 1  # one call per token after the prefill's
        # each accepted forced token saves its call (at most one call more: a draft whose last
        # token ended the reply has no bonus token); measured: 14 calls against 84
        assert n - 1 - forced <= on.steps <= n - forced, (on.steps, off.steps, forced)
        assert on.spec is None  # (speculative_tokens 0: the n-gram path is off)
    finally:
        on.stop()
        off.stop()


def test_forced_tokens_logprobs_are_the_plain_paths(lm, artifact, guides):
    on, off = _engine(lm, artifact, True), _engine(lm, artifact, False)
    try:
        out = OutputParams(logprobs=True, top_logprobs=3)
        got = _run(on, _mixed(guides, GREEDY, out))
        want = _run(off, _mixed(guides, GREEDY, out))
        assert _ids(got) == _ids(want)
        worst = 0.0
        for (ga, _), (wa, _) in zip(got, want):  # every token, the forced ones among them
            for a, b in zip(ga, wa):
                assert list(a.top_ids) == list(b.top_ids)
                x = np.array([a.logprob, *a.top_logprobs], np.float64)
                y = np.array([b.logprob, *b.top_logprobs], np.float64)
                assert np.array_equal(np.isfinite(x), np.isfinite(y))  # (masked: -inf)
                fin = np.isfinite(x)
                worst = max(worst, float(np.abs(x[fin] - y[fin]).max(initial=0.0)))
        assert worst <= LOGPROB_TOL, f"max |dlogprob| {worst:.3g}"
        assert on.fast_forward.accepted > 0
    finally:
        on.stop()
        off.stop()


@pytest.mark.parametrize("split", [3, 12])
def test_a_resumed_seeded_stream_continues_identically(lm, artifact, guides, split):
    """A constrained seeded stream cut after ``split`` tokens (inside the forced key, 3, and
    after it, 12) and resumed: the same tokens as uncut, fast-forward on, and as with it off."""
    on, off = _engine(lm, artifact, True), _engine(lm, artifact, False)
    try:
        spec = ConstraintSpec.json_schema(SCHEMA)
        whole = _ids(_run(on, [_req(guides, spec, SEEDED)]))[0]
        assert whole == _ids(_run(off, [_req(guides, spec, SEEDED)]))[0]
        rest = _ids(_run(on, [_req(guides, spec, SEEDED, resume=whole[:split])]))[0]
        assert whole[:split] + rest == whole
    finally:
        on.stop()
        off.stop()


def test_a_failed_iteration_restarts_constrained_rows_exactly(lm, artifact, guides):
    """An iteration that raises (injected after its step ran) restarts every row from the
    tokens it delivered (server/resume.py ``restart``): a constrained row gets a fresh matcher
    brought to where it was, and every output is the unfailed run's."""
    engines = [_engine(lm, artifact, True) for _ in range(2)]
    seen = fail_iteration(engines[1], 6)
    try:
        want, got = (_run(e, _mixed(guides, SEEDED)) for e in engines)
        assert seen[0] > 6 and _ids(got) == _ids(want)
        assert [f.reason for _, f in got] == [f.reason for _, f in want]
        assert [f.text for _, f in got] == [f.text for _, f in want]
    finally:
        for e in engines:
            e.stop()

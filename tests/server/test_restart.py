"""A failed engine iteration (server/resume.py ``restart``, ``Engine._fail_all``) on the numpy
fake model: the requests in flight start again from the tokens their callers have had and their
streams go on with exactly the events an unfailed run gives (greedy, seeded, a stop string,
tokens held back for a staged caller, a failure after the step's tokens went out); a request
with no seed of its own keeps the one it drew; a resumed request caught before its admission
keeps its place; a second failure ends the restarted requests with an error after the tokens
they had, never different ones; a deadline passing while one waits to be re-admitted ends it
as a request that started; with no new KV cache to be had every request ends, none hangs."""
from __future__ import annotations

import pytest
from fake_lm import FakeLM, engine_maker
from kvserve_testing import fail_iteration
from test_resume import FirstTokens

from kvserve.model.sampling import SamplingParams
from kvserve.server import resume
from kvserve.server.domain import (FinishEvent, FinishReason, GenerateRequest, OutputParams,
                                   StopParams, TokenEvent)

V = 64


class FailingLM(FakeLM):
    """The fake model, raising in the decode calls numbered in ``fail_at`` (1-based)."""

    def __init__(self, fail_at=()):
        super().__init__(V)
        self.fail_at = set(fail_at)

    def decode(self, kv, n, tokens, attention=False):
        if self.calls["decode"] + 1 in self.fail_at:
            self.calls["decode"] += 1
            raise RuntimeError("boom")
        return super().decode(kv, n, tokens, attention)


@pytest.fixture(params=[0.0, 0.05], ids=["woken-per-token", "staged"])
def make_engine(request):
    make, engines = engine_maker(V, request.param, FailingLM)
    yield make
    for e in engines:
        e.stop()


def _requests() -> list[GenerateRequest]:
    def req(prompt, sampling, **stop):
        return GenerateRequest(list(prompt), sampling, StopParams(**stop), OutputParams())
    return [req([3, 9, 4], SamplingParams(), max_new_tokens=40),
            req([5, 1], SamplingParams(temperature=0.9, seed=77), max_new_tokens=40),
            req([7, 7, 2, 8], SamplingParams(temperature=1.2, seed=5), max_new_tokens=40,
                stop=["t11 t"]),
            req([2, 6], SamplingParams(temperature=0.8), max_new_tokens=40)]  # seeded by
    # the server


def _run(engine, reqs):
    """Per request: (its events as (index, id, text), its FinishEvent)."""
    out = []
    for h in engine.submit_many(reqs):
        evs = list(h)
        fin = evs.pop()
        assert isinstance(fin, FinishEvent) and all(isinstance(e, TokenEvent) for e in evs)
        out.append(([(e.index, e.token_id, e.text) for e in evs], fin))
    return out


def _whole(run) -> None:
    """A stream that ended normally is whole: indices 0.. without a gap or a repeat, its text
    the events' texts, its count theirs."""
    for evs, fin in run:
        assert [e[0] for e in evs] == list(range(len(evs)))
        assert fin.text == "".join(e[2] for e in evs) and fin.generated_tokens == len(evs)


@pytest.mark.parametrize("fail_at", [(1,), (6,), (6, 7), (3, 30)],
                         ids=["first-step", "mid", "twice-in-a-row", "apart"])
def test_a_failed_step_restarts_the_requests_in_flight_unchanged(make_engine, fail_at):
    reference, _ = make_engine()
    want = _run(reference, _requests())
    metrics = FirstTokens()
    engine, lm = make_engine(FailingLM(fail_at), metrics=metrics)
    got = _run(engine, _requests())
    _whole(got)
    if len(fail_at) == 1:
        for (evs, fin), (ref, ref_fin) in zip(got[:3], want[:3]):
            assert evs == ref and (fin.reason, fin.text) == (ref_fin.reason, ref_fin.text)
            assert 0 < fin.timings.ttft <= fin.timings.total
        assert got[3][1].reason is FinishReason.LENGTH and len(got[3][0]) == 40
        assert metrics.first == 4  # one first token each, not one per start
        return
    # a second failure while they were in flight again: the error, after a prefix of the
    # tokens the unfailed run gave; those that ended between the two failures ended as in it
    assert got[0][1].reason is FinishReason.ERROR  # (40 tokens, no stop: in flight)
    for (evs, fin), (ref, ref_fin) in zip(got[:3], want[:3]):
        if fin.reason is FinishReason.ERROR:
            assert evs == ref[:len(evs)] and fin.error == "internal error"
        else:
            assert evs == ref and fin.text == ref_fin.text


def test_a_failure_after_the_steps_tokens_went_out_repeats_none(make_engine):
    """The iteration raises after its step ran (its tokens sent or held): the restarted
    streams neither repeat nor lose a token."""
    reference, _ = make_engine()
    want = _run(reference, _requests())
    engine, _ = make_engine()
    fail_iteration(engine, 9)
    got = _run(engine, _requests())
    _whole(got)
    assert [g[0] for g in got[:3]] == [w[0] for w in want[:3]]
    assert [g[1].text for g in got[:3]] == [w[1].text for w in want[:3]]


def test_restart_keeps_the_seed_the_request_drew():
    """A request without a seed of its own goes on with the one the server drew for it."""
    make, engines = engine_maker(V, 0.0, FailingLM)
    try:
        engine, _ = make(FailingLM((5,)))
        drawn = []
        real = resume.restart

        def spy(seq, output):
            new = real(seq, output)
            drawn.append((seq.seed, new.req.sampling.seed, new.req.resume,
                          seq.generated[:len(seq.text)]))
            return new
        resume.restart = spy
        try:
            (evs, fin), = _run(engine, _requests()[3:])
        finally:
            resume.restart = real
        (seed, kept, delivered, had), = drawn
        assert seed is not None and kept == seed and list(delivered) == had and had
        assert fin.reason is FinishReason.LENGTH and len(evs) == 40
    finally:
        for e in engines:
            e.stop()


def test_a_model_that_keeps_failing_ends_each_request_with_an_error(make_engine):
    engine, lm = make_engine(FailingLM(range(1, 1000)))
    got = _run(engine, _requests())
    assert all(fin.reason is FinishReason.ERROR and fin.error == "internal error"
               for _, fin in got)
    assert lm.calls["decode"] >= 2  # once, then once after the restart


def _drain(handle, timeout: float = 20.0):
    """A handle's events, failing instead of hanging when no final event comes."""
    evs = []
    while True:
        ev = handle.events.get(timeout=timeout)
        evs.append(ev)
        if isinstance(ev, FinishEvent):
            return evs


def test_a_resumed_request_failing_before_its_admission_keeps_its_place(make_engine):
    """A resumed request (it carries the tokens an earlier call delivered) caught by a failure
    before it was admitted goes on after those tokens, not from the start."""
    reference, _ = make_engine()
    (ref, _), = _run(reference, _requests()[:1])
    engine, _ = make_engine()
    fail_iteration(engine, 1, before=True)  # (the first iteration admits it)
    req = _requests()[0]
    req.resume = tuple(e[1] for e in ref[:5])
    evs = _drain(engine.submit(req))
    fin = evs.pop()
    assert [(e.index, e.token_id, e.text) for e in evs] == ref[5:]
    assert fin.reason is FinishReason.LENGTH and fin.generated_tokens == 40


def test_a_restarted_request_past_its_deadline_ends_as_one_that_started(make_engine):
    """Its deadline passing while it waits to be re-admitted: TIME_LIMIT after its tokens,
    without the queue's "at capacity, never started" error."""
    import time
    engine, _ = make_engine()
    req = _requests()[0]
    req.deadline = time.monotonic() + 0.5
    seen = [0]

    def hook(work):
        work()
        seen[0] += 1
        if seen[0] == 3:
            time.sleep(max(0.0, req.deadline - time.monotonic()) + 0.05)
            raise RuntimeError("late")
    engine.iteration_hook = hook
    evs = _drain(engine.submit(req))
    fin = evs.pop()
    assert fin.reason is FinishReason.TIME_LIMIT and fin.error == "" and len(evs) >= 3


def test_no_new_cache_after_a_failure_ends_every_request(make_engine):
    """The model's new KV cache fails too: every request ends (the restarted ones with the
    error), none hangs, and the engine refuses new ones."""
    class NoCache(FailingLM):
        made = 0

        def new_cache(self, max_batch, capacity=128):
            NoCache.made += 1
            if NoCache.made > 1:
                raise MemoryError("no memory for a new cache")
            return super().new_cache(max_batch, capacity)
    engine, _ = make_engine(NoCache((3,)))
    for h in engine.submit_many(_requests()):
        fin = _drain(h)[-1]
        assert fin.reason is FinishReason.ERROR
    engine._thread.join(5)
    assert not engine.alive

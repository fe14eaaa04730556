"""Resumed requests (server/resume.py) on the numpy fake model: a request that carries the
tokens an earlier call delivered continues exactly as the uninterrupted call: the same
events (index, id, text) after the split, the same end and the same whole text, for greedy
and seeded sampling, across a stop string that spans the split, with penalties that count the
earlier tokens and a min_new_tokens that counts them too. A resumed stream's first new token
is put at once and timed (TTFT), and it costs one prefill of its delivered tokens."""
from __future__ import annotations

import dataclasses
import re

import pytest
from fake_lm import FakeLM, engine_maker, word_token_bytes

from kvserve.model.sampling import SamplingParams
from kvserve.server import resume
from kvserve.server.detok import TokenBytes
from kvserve.server.domain import (FinishReason, GenerateRequest, InvalidArgument, OutputParams,
                                   StopParams, TokenEvent)
from kvserve.server.interfaces import NullMetrics

V = 64
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, seed=1234)


def _token_bytes() -> TokenBytes:
    return word_token_bytes(V)


class CountingLM(FakeLM):
    """The fake model, counting the tokens fed through prefill / extend and decode."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prefilled = self.decoded = 0

    def prefill(self, kv, lo, prompts, attention=False, last=False):
        self.prefilled += sum(len(p) for p in prompts)
        return super().prefill(kv, lo, prompts, attention, last)

    def extend(self, kv, slot, tokens, last=False):
        self.prefilled += len(tokens)
        return super().extend(kv, slot, tokens, last)

    def decode(self, kv, n, tokens, attention=False):
        self.decoded += n
        return super().decode(kv, n, tokens, attention)


class FirstTokens(NullMetrics):
    def __init__(self):
        self.first = 0

    def token(self, first: bool, seconds: float) -> None:
        self.first += first


@pytest.fixture(params=[0.0, 0.05], ids=["woken-per-token", "staged"])
def make_engine(request):
    make, engines = engine_maker(V, request.param, lambda: CountingLM(V))
    yield make
    for e in engines:
        e.stop()


def _req(prompt, sampling=GREEDY, **stop) -> GenerateRequest:
    return GenerateRequest(prompt_ids=list(prompt), sampling=sampling,
                           stopping=StopParams(**stop), output=OutputParams())


def _run(engine, req):
    """(events as (index, id, text, special), the FinishEvent)."""
    evs, fin = [], None
    for ev in engine.submit(req):
        if isinstance(ev, TokenEvent):
            evs.append((ev.index, ev.token_id, ev.text, ev.special))
        else:
            fin = ev
    return evs, fin


def _resumed(req: GenerateRequest, delivered) -> GenerateRequest:
    return dataclasses.replace(req, resume=tuple(e[1] for e in delivered))


def _assert_resumes(engine, req, splits):
    """Every split of the uninterrupted stream resumes into exactly its tail."""
    full, fin = _run(engine, req)
    for k in splits:
        assert k < len(full)
        tail, rfin = _run(engine, _resumed(req, full[:k]))
        assert tail == full[k:], k
        assert (rfin.reason, rfin.stop_sequence, rfin.generated_tokens, rfin.text,
                rfin.prompt_tokens) == (fin.reason, fin.stop_sequence, fin.generated_tokens,
                                        fin.text, fin.prompt_tokens), k
    return full, fin


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resumed_stream_continues_the_uninterrupted_one(make_engine, sampling):
    engine, _ = make_engine()
    req = _req([3, 1, 4], sampling, max_new_tokens=24, ignore_eos=True)
    full, fin = _assert_resumes(engine, req, [1, 2, 11, 23])
    assert fin.reason is FinishReason.LENGTH and len(full) == 24
    if sampling is SEEDED:  # the positions matter: a resume whose draws restarted at
        # position 0 (a fresh request of prompt + delivered tokens) differs
        fresh, _ = _run(engine, _req([3, 1, 4, *(e[1] for e in full[:11])], sampling,
                                     max_new_tokens=13, ignore_eos=True))
        assert [e[1] for e in fresh] != [e[1] for e in full[11:]]


def test_a_stop_string_across_the_split(make_engine):
    engine, lm = make_engine()
    ref = lm.reference([7], 20)
    stop = f"t{ref[4]} t{ref[5]}"  # token 4's text is held back as a possible stop prefix
    req = _req([7], max_new_tokens=20, ignore_eos=True, stop=(stop,))
    full, fin = _assert_resumes(engine, req, [4, 5])
    assert fin.reason is FinishReason.STOP_SEQUENCE and fin.stop_sequence == stop
    assert len(full) == 6 and full[4][2] == "" and stop not in fin.text
    # the split right after token 4: the resumed call releases no text for it either
    tail, _ = _run(engine, _resumed(req, full[:5]))
    assert tail == [full[5]] and tail[0][2] == ""


@pytest.mark.parametrize("sampling", [
    SamplingParams(presence_penalty=2.0, frequency_penalty=2.0),
    SamplingParams(temperature=0.9, seed=7, repetition_penalty=1.5, frequency_penalty=2.0)],
    ids=["greedy", "seeded"])
def test_penalties_count_the_tokens_before_the_split(make_engine, sampling):
    engine, _ = make_engine()
    req = _req([5], sampling, max_new_tokens=30, ignore_eos=True)
    full, _ = _assert_resumes(engine, req, [3, 10, 20])
    plain, _ = _run(engine, _req([5], dataclasses.replace(
        sampling, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0),
        max_new_tokens=30, ignore_eos=True))
    assert [e[1] for e in plain] != [e[1] for e in full]  # the penalties change the output
    if sampling.greedy:  # a continuation that saw the delivered tokens as prompt only
        # (presence and frequency penalties count generated ones) differs from the true one
        naive, _ = _run(engine, _req([5, *(e[1] for e in full[:10])], sampling,
                                     max_new_tokens=20, ignore_eos=True))
        assert [e[1] for e in naive] != [e[1] for e in full[10:]]


def test_min_new_tokens_counts_the_delivered_tokens(make_engine):
    lm = CountingLM(V)
    ref = lm.reference([7], 20)
    eos = ref[3]  # the model wants to end after 4 tokens
    engine, _ = make_engine(lm, eos_id=eos)
    req = _req([7], max_new_tokens=20, min_new_tokens=9)
    full, fin = _assert_resumes(engine, req, [2, 3, 4, 8, 9])
    assert len(full) >= 9 and all(e[1] != eos for e in full[:9])
    # a fresh request for the rest would end at once: nothing bans the eos there
    naive, nfin = _run(engine, _req([7, *(e[1] for e in full[:3])], max_new_tokens=17))
    assert [e[1] for e in naive] == [eos] and nfin.reason is FinishReason.EOS_TOKEN


def test_delivered_tokens_that_ended_the_stream_get_its_complete(make_engine):
    engine, lm = make_engine()
    req = _req([2], max_new_tokens=6, ignore_eos=True)
    full, fin = _run(engine, req)
    tail, rfin = _run(engine, _resumed(req, full))
    assert tail == [] and rfin.reason is FinishReason.LENGTH
    assert (rfin.generated_tokens, rfin.text) == (6, fin.text)


def test_the_first_new_token_is_put_at_once_and_timed(make_engine):
    metrics = FirstTokens()
    engine, _ = make_engine(metrics=metrics)
    req = _req([1, 2], max_new_tokens=12, ignore_eos=True)
    full, _ = _run(engine, req)
    assert metrics.first == 1
    h = engine.submit(_resumed(req, full[:5]))
    ev = h.events.get(timeout=10)  # the first new token alone (a staged caller: put at once)
    assert isinstance(ev, TokenEvent) and ev.index == 5
    *_, fin = list(h)
    assert metrics.first == 2 and fin.timings.ttft > 0


def test_a_resume_costs_one_prefill_of_its_delivered_tokens(make_engine):
    """Measured in tokens fed to the model: the resumed call prefills prompt + delivered
    tokens once and decodes only the rest."""
    engine, lm = make_engine()
    prompt, n, k = [9, 8, 7, 6], 20, 12
    req = _req(prompt, SEEDED, max_new_tokens=n, ignore_eos=True)
    full, _ = _run(engine, req)
    assert (lm.prefilled, lm.decoded) == (len(prompt), n - 1)
    lm.prefilled = lm.decoded = 0
    _run(engine, _resumed(req, full[:k]))
    assert (lm.prefilled, lm.decoded) == (len(prompt) + k, n - k - 1)


def test_check_refuses_what_cannot_be_continued():
    tb, eos = _token_bytes(), frozenset({5})
    ok = _req([1], max_new_tokens=8, stop=("t3 t4",))
    resume.check(dataclasses.replace(ok, resume=(1, 2, 3)), tb, eos)  # fine
    resume.check(dataclasses.replace(ok, resume=(1, 2, 5)), tb, eos)  # ends at the last: fine
    cases = {
        "needs its sampling.seed": dataclasses.replace(
            ok, sampling=SamplingParams(temperature=0.9), resume=(1,)),
        "max_new_tokens is 8": dataclasses.replace(ok, resume=(1,) * 9),
        "token 1 ended the stream (eos_token)": dataclasses.replace(ok, resume=(1, 5, 2)),
        "token 3 ended the stream (stop_sequence)": dataclasses.replace(
            ok, resume=(1, 3, 3, 4, 1)),
    }
    for want, req in cases.items():
        with pytest.raises(InvalidArgument, match=re.escape(want)):
            resume.check(req, tb, eos)

"""The engine's speculation policy (server/speculation.py), as pure logic: when a step
verifies drafts, how long the drafts are, and when speculation pauses itself."""
from __future__ import annotations

import pytest

from kvserve.model.sampling import SamplingParams
from kvserve.server.domain import GenerateRequest, OutputParams, StopParams
from kvserve.server.sequence import Handle, Sequence
from kvserve.server.ngram import NgramIndex
from kvserve.server.speculation import (_INDEX_CHUNK, _MAX_SKIP, _PAUSE, _PAUSE_MAX_SECONDS,
                                        _REFRESH,
                                        _WINDOW, _WINDOW_STEPS, Backoff, Speculator)
from kvserve.server.step_costs import StepCosts


def _seq(prompt, generated=(), max_new=64, attention=False) -> Sequence:
    out = OutputParams(attention_layers=(0,), attention_heads=(0,)) if attention \
        else OutputParams()
    req = GenerateRequest(list(prompt), SamplingParams(), StopParams(max_new_tokens=max_new),
                          out)
    s = Sequence(req, Handle("r", lambda: None), submitted=0.0)
    s.generated = list(generated)
    return s


def _plain(b: Backoff, n: int, seconds: float) -> None:
    """A plain step at batch size n, as the model runner reports it."""
    b.plain_step(n, b.costs.plain_step(n, seconds))


def test_a_batch_size_is_measured_plain_before_it_verifies_and_refreshed_every_so_often():
    b = Backoff(StepCosts())
    assert not b.allow(2)  # no plain figure at batch 2 yet
    _plain(b, 2, 0.010)
    verified = 0
    while b.allow(2):
        b.verify_step(2, 0.012, 6)  # 6 tokens in 12 ms against 2 in 10 ms: worth it
        verified += 1
    assert verified == _REFRESH  # then a plain step refreshes the figure
    _plain(b, 2, 0.010)
    assert b.allow(2)


def test_a_refresh_after_verification_is_two_plain_steps_and_measures_the_second():
    b = Backoff(StepCosts())
    _plain(b, 4, 0.010)
    while b.allow(4):  # the runner reports a verification to both
        b.costs.verify_step(4, 3, 0.015)
        b.verify_step(4, 0.015, 8)
    _plain(b, 4, 0.014)  # (after a verification: pays for the change of shape)
    assert not b.allow(4) and b.costs.plain[4] == pytest.approx(0.010)
    _plain(b, 4, 0.012)
    assert b.allow(4) and b.costs.plain[4] == pytest.approx(0.011)  # (the steady ones' median)


def test_speculation_pauses_while_it_yields_fewer_tokens_per_second():
    b = Backoff(StepCosts())
    _plain(b, 8, 0.010)  # 800 tokens/s
    steps = 0
    while b.allow(8) and steps < 100:
        b.verify_step(8, 0.020, 9)  # 450 tokens/s: a loss
        steps += 1
    assert steps == _WINDOW, "it kept verifying at a loss"  # one window weighed, then paused
    paused = sum(not b.allow(8) for _ in range(_PAUSE))
    assert paused == _PAUSE - 1  # (the first refusal above started the pause)
    assert b.allow(8)  # then it tries again ...
    for _ in range(_WINDOW):
        b.verify_step(8, 0.020, 9)
    _plain(b, 8, 0.010)  # (the refresh, so that only the pause refuses below)
    assert sum(not b.allow(8) for _ in range(4 * _PAUSE)) == 2 * _PAUSE  # ... losing again:
    assert b.pause[8] == 4 * _PAUSE  # a pause twice as long, the next one twice again ...
    for _ in range(_WINDOW):  # ... and a window that gains halves it
        b.verify_step(8, 0.010, 16)
    assert b.pause[8] == 2 * _PAUSE and b.longest_pause(8) >= 8 * _PAUSE


def test_the_plain_steps_between_verifications_count_against_speculation():
    """Verifications that win alone (10 tokens in 10 ms at batch 8 against 8 in 10 ms) but
    whose plain steps between them pay for lookups and for the change of shape (13 ms each,
    three for every verification): the window as a whole yields fewer tokens per second than
    plain steps do, so speculation pauses (weighed on its verifications alone it went on)."""
    b = Backoff(StepCosts())
    _plain(b, 8, 0.010)
    steps = 0
    while b.allow(8) and steps < 200:
        b.verify_step(8, 0.010, 10)
        for _ in range(3):
            b.allow(8)
            b.plain_step(8, False, 0.013)
        steps += 1
    assert b.paused[8] and b.gain < 1 and steps <= _WINDOW


def _losing_window(b: Backoff, n: int, plain: float) -> None:
    """A window of verifications that yields half the plain steps' tokens per second (``b``
    then pauses at ``n``), and the pause waited out."""
    while b.allow(n):
        b.verify_step(n, 2 * plain, n)
    while not b.allow(n):
        pass
    b.plain_step(n, True, plain)


def test_lookups_that_never_draft_pause_speculation_where_verifying_lost():
    """No verification, every plain step paying for the lookups (11 ms against a plain
    step's 10), where the last window of verifications lost (a compute-bound batch): after
    ``_WINDOW_STEPS`` steps speculation pauses again, and the lookups stop."""
    b = Backoff(StepCosts())
    _plain(b, 2, 0.010)
    _losing_window(b, 2, 0.010)
    steps = 0
    while b.allow(2) and steps < 10 * _WINDOW_STEPS:
        b.plain_step(2, True, 0.011)
        steps += 1
    assert steps == _WINDOW_STEPS - 1 and b.paused[2] == 2 * _PAUSE - 1  # (+ the one above)


def test_lookups_go_on_where_verifying_pays_and_pause_where_never_judged():
    """The same dear lookups where windows of verifications have been gaining: no pause (a
    pause there misses the drafts that come next); where none was ever judged (the weighing
    refused nearly every draft), a window of them pauses speculation like a losing one."""
    b = Backoff(StepCosts())
    _plain(b, 2, 0.010)
    for _ in range(_WINDOW):  # 4 tokens in 10 ms: it pays
        assert b.allow(2)
        b.verify_step(2, 0.010, 4)
    assert b.trend[2] > 0
    for _ in range(10 * _WINDOW_STEPS):
        assert b.allow(2)
        b.plain_step(2, True, 0.011)
    assert not b.paused.get(2)
    _plain(b, 4, 0.010)  # (the second is the one measured)
    _plain(b, 4, 0.010)
    steps = 0
    while b.allow(4) and steps < 10 * _WINDOW_STEPS:
        b.plain_step(4, True, 0.011)
        steps += 1
    assert 4 not in b.trend and steps == _WINDOW_STEPS and b.paused[4] == _PAUSE - 1


def test_a_window_of_lookups_never_shortens_the_next_pause():
    """A window without verifications that yields as much as plain steps (its lookups cost
    nothing measurable: the machine's noise put it over 1) leaves the next pause as long as
    the losing windows made it; windows of verifications that gain halve it, once their
    trend is a gain."""
    b = Backoff(StepCosts())
    _plain(b, 2, 0.010)
    _losing_window(b, 2, 0.010)  # a pause of 16; then lookups losing: 32, 64; next 128
    for _ in range(2):
        while b.allow(2):
            b.plain_step(2, True, 0.011)
        while not b.allow(2):
            pass
        b.plain_step(2, True, 0.011)
    assert b.pause[2] == 8 * _PAUSE
    for _ in range(_WINDOW_STEPS):
        assert b.allow(2)
        b.plain_step(2, True, 0.0099)
    assert b.gain > 1 and b.pause[2] == 8 * _PAUSE
    for _ in range(_WINDOW):  # a window of verifications that gains, but the trend of the
        assert b.allow(2)  # judged windows is still a loss: a pause (of 128; next 256)
        b.verify_step(2, 0.010, 4)
    assert b.gain > 1 and b.trend[2] < 0 and b.paused[2] == 8 * _PAUSE
    while not b.allow(2):
        pass
    b.plain_step(2, True, 0.010)  # (a fresh plain figure)
    for _ in range(_WINDOW):  # another: the trend gains, and the next pause is halved
        assert b.allow(2)
        b.verify_step(2, 0.010, 4)
    assert b.trend[2] > 0 and not b.paused.get(2)
    assert b.pause[2] == min(16 * _PAUSE, b.longest_pause(2)) // 2


def test_a_request_with_its_own_draft_source_drafts_through_a_pause():
    """OpenAI's ``prediction`` (``lookup_ids``): its row drafts while the batch size is paused,
    alone (the other rows wait the pause out, and the step counts in it); the plain figure's
    refresh still comes first."""
    sp = Speculator(k_max=4, max_seq_len=256)
    _plain(sp.backoff, 2, 0.01)
    sp.backoff.paused[2] = 50
    plain = _seq([20, 21, 22, 20], generated=[21])  # (would draft 22, 20, 21, ...)
    sp.admit(plain)
    assert sp.drafts([plain, plain]) is None
    req = GenerateRequest([20, 21, 22], SamplingParams(), StopParams(max_new_tokens=16),
                          OutputParams(), lookup_ids=(30, 31, 32, 33, 34))
    predicted = Sequence(req, Handle("p", lambda: None), submitted=0.0)
    predicted.generated = [30]
    sp.admit(predicted)
    assert sp.drafts([plain, predicted]) == [[], [31, 32, 33, 34]]
    assert sp.backoff.paused[2] == 48 and not sp.backoff.consulted
    sp.backoff.since_plain[2] = _REFRESH  # a refresh due: a plain step, prediction or not
    assert sp.drafts([plain, predicted]) is None


def test_a_pause_holds_at_its_batch_size_only():
    """Speculation losing at batch 8 (compute-bound) pauses there; a step at batch 1 may still
    verify, and its steps do not shorten batch 8's pause."""
    b = Backoff(StepCosts())
    _plain(b, 8, 0.010)
    _plain(b, 1, 0.004)  # (the second at batch 1 is the one measured)
    _plain(b, 1, 0.004)
    while b.allow(8):
        b.verify_step(8, 0.020, 9)
    assert b.paused[8] == _PAUSE - 1
    for _ in range(3 * _PAUSE):
        assert b.allow(1)
        b.verify_step(1, 0.004, 2)
        _plain(b, 1, 0.004)  # (two: the second is steady, a fresh plain figure)
        _plain(b, 1, 0.004)
    assert b.paused[8] == _PAUSE - 1 and not b.allow(8)


def test_pauses_grow_to_the_cap_while_every_window_loses():
    """Doubling, up to ``_PAUSE_MAX_SECONDS`` of plain steps at that batch size."""
    b = Backoff(StepCosts())
    _plain(b, 8, 0.010)
    lengths = []
    for _ in range(12):
        while b.allow(8):
            b.verify_step(8, 0.020, 9)
        lengths.append(b.paused[8] + 1)
        while not b.allow(8):
            pass
        _plain(b, 8, 0.010)
    assert lengths[:4] == [_PAUSE, 2 * _PAUSE, 4 * _PAUSE, 8 * _PAUSE]
    assert max(lengths) == lengths[-1] == int(_PAUSE_MAX_SECONDS / 0.010) == b.longest_pause(8)


def test_a_plain_step_taken_while_paused_is_not_weighed():
    b = Backoff(StepCosts())
    _plain(b, 1, 0.010)
    b.paused[1] = 3
    for _ in range(3):
        assert not b.allow(1)
        b.plain_step(1, True, 0.050)  # (slow, but speculation was off: not its cost)
    assert b.window.get(1, [0, 0, 0, 0.0])[1] == 0


def test_one_slow_step_does_not_pause_speculation():
    b = Backoff(StepCosts())
    _plain(b, 1, 0.010)  # 100 tokens/s
    for i in range(4 * _WINDOW):  # 3 tokens in 12 ms (250 tokens/s), one step stalled 50 ms
        if i % _WINDOW == 0:
            _plain(b, 1, 0.010)  # (the refreshes)
        assert b.allow(1)
        b.verify_step(1, 0.050 if i == 3 else 0.012, 3)
    assert not b.paused.get(1) and b.gain > 1


def test_a_long_prompt_is_indexed_over_several_steps():
    """A prompt of 3.5 chunks is indexed a chunk per step (no step of the batch waits for all
    of it): no draft until the index is whole, then the drafts of an index built at once."""
    import random
    rnd = random.Random(4)
    prompt = [rnd.randrange(1000) for _ in range(_INDEX_CHUNK * 7 // 2)]
    prompt[-6:] = prompt[100:106]  # its end repeats an earlier stretch: a draft from there
    sp = Speculator(k_max=4, max_seq_len=8 * _INDEX_CHUNK)
    _plain(sp.backoff, 1, 0.01)
    s = _seq(prompt, generated=[prompt[106]], max_new=64)
    sp.admit(s)
    sizes = []
    for _ in range(3):
        assert sp._propose(s) == []
        sizes.append(len(s.drafting.index))
        assert s.drafting.skip == 0  # (still indexing: not a lookup that found nothing)
    assert sizes == [_INDEX_CHUNK, 2 * _INDEX_CHUNK, 3 * _INDEX_CHUNK]
    whole = NgramIndex(prompt + s.generated)
    assert sp._propose(s) == whole.propose(4) == prompt[107:111]
    assert len(s.drafting.index) == len(prompt) + 1


def test_drafts_from_the_sequence_itself_within_its_room():
    sp = Speculator(k_max=4, max_seq_len=256)
    _plain(sp.backoff, 1, 0.01)
    s = _seq([5, 6, 7, 8, 9, 5, 6], max_new=64)
    sp.admit(s)
    # the prompt's index is built at the first lookup, after the first token: not before it
    assert s.drafting is not None and s.drafting.index is None
    s.generated = [7]  # ... 5 6 7: the earlier "5 6 7" was followed by 8 9 5 6
    assert sp.drafts([s]) == [[8, 9, 5, 6]]
    assert len(s.drafting.index) == 8  # the prompt and the token since
    short = _seq([5, 6, 7, 8, 9, 5, 6], generated=[7], max_new=3)  # 2 new tokens left
    sp.admit(short)
    assert sp.drafts([short]) == [[8]]  # the draft and the token after it fit


def test_a_sequence_whose_lookups_find_nothing_looks_less_often():
    sp = Speculator(k_max=4, max_seq_len=256)
    _plain(sp.backoff, 2, 0.01)
    lonely = _seq(list(range(10, 40)), generated=[99])
    loopy = _seq([1, 2, 3, 1, 2], generated=[3])
    sp.admit(lonely)
    sp.admit(loopy)
    looks = 0
    for _ in range(40):
        before = lonely.drafting.empty
        sp.drafts([lonely, loopy])
        looks += lonely.drafting.empty != before
    assert 40 // _MAX_SKIP <= looks <= 40 // _MAX_SKIP + 3  # 1, 2, then every 4 steps


def test_no_verification_while_a_row_wants_attention():
    sp = Speculator(k_max=4, max_seq_len=256)
    _plain(sp.backoff, 2, 0.01)
    loopy = _seq([1, 2, 3, 1, 2], generated=[3])
    diag = _seq([1, 2, 3], generated=[4], attention=True)
    sp.admit(loopy)
    sp.admit(diag)
    assert diag.drafting is None
    assert sp.drafts([loopy, diag]) is None


def test_prediction_usage_counts_the_drafts_prediction_tokens_only():
    """A draft copied from the prediction counts in the usage's prediction tokens, as far as
    its tokens are the prediction's: one that runs on from the prediction's last token into
    the prompt counts that one token; a draft from the prompt counts none."""
    spec = Speculator(4, 256)
    req = GenerateRequest([14, 15, 16, 12], SamplingParams(), StopParams(max_new_tokens=20),
                          OutputParams(), lookup_ids=(10, 11, 12, 13))
    seq = Sequence(req, Handle("p", lambda: None), submitted=0.0)
    spec.admit(seq)
    # source 10 11 12 13 | 14 15 16 12: the last token (12) follows on from index 3
    assert spec._propose(seq) == [13, 14, 15, 16]
    spec.record(seq, 4, 3)
    assert (seq.prediction_accepted, seq.prediction_rejected) == (1, 0)
    spec.record(seq, 4, 0)
    assert (seq.prediction_accepted, seq.prediction_rejected) == (1, 1)
    seq.generated.extend([13, 14])  # now "... 12 13 14": the prompt's 14 is followed by 15
    assert spec._propose(seq) == [15, 16, 12, 13]
    spec.record(seq, 4, 4)
    assert (seq.prediction_accepted, seq.prediction_rejected) == (1, 1)

"""The fast-forward policy (server/fast_forward.py) as pure logic with real llguidance matchers
(torch-free): which rows draft their forced tokens, how long those drafts are, and when a
batch's call shape makes them not worth it."""
from __future__ import annotations

import pytest

from kvserve.model.sampling import SamplingParams
from kvserve.server.domain import GenerateRequest, OutputParams, StopParams
from kvserve.server.fast_forward import _FORGET, FastForward
from kvserve.server.ngram import MAX_K
from kvserve.server.sequence import Handle, Sequence
from kvserve_testing import TRAIN_TEXTS

pytest.importorskip("llguidance")

KEY = "a_rather_long_fixed_key_name"  # spelled out a character or two per token


@pytest.fixture(scope="module")
def guide():
    from kvserve.model.tokenizer import train_bpe
    from kvserve.server.constraints import GuideTokenizer

    tok = train_bpe(TRAIN_TEXTS, vocab_size=512, min_frequency=1)
    return GuideTokenizer(tok.to_str(), tok.vocab_size, [tok.eos_id])


def _seq(guide, pattern: str | None, max_new=64, attention=False, prompt=(1, 2, 3)) -> Sequence:
    from kvserve.server.constraints import ConstraintSpec

    out = OutputParams(attention_layers=(0,), attention_heads=(0,)) if attention \
        else OutputParams()
    c = guide.constraint(ConstraintSpec.regex(pattern)) if pattern is not None else None
    req = GenerateRequest(list(prompt), SamplingParams(), StopParams(max_new_tokens=max_new),
                          out, constraint=c)
    return Sequence(req, Handle("r", lambda: None), submitted=0.0)


def test_a_constrained_row_drafts_its_forced_tokens_within_its_room(guide):
    ff = FastForward(max_seq_len=256)
    s = _seq(guide, KEY + "[0-9]")
    forced = s.req.constraint.forced()
    assert len(forced) > MAX_K  # the key is longer than one draft
    assert ff.drafts([s], None) == [forced[:MAX_K]]
    short = _seq(guide, KEY + "[0-9]", max_new=4)  # 3 more tokens, the draft's + the next
    assert ff.drafts([short], None) == [forced[:3]]
    edge = _seq(guide, KEY + "[0-9]", prompt=range(250))  # 6 positions of context left
    assert ff.drafts([edge], None) == [forced[:5]]
    assert s.req.constraint.forced() == forced  # drafting consumed nothing


def test_free_rows_keep_their_ngram_drafts_and_open_grammars_draft_nothing(guide):
    ff = FastForward(max_seq_len=256)
    free, keyed, open_ = _seq(guide, None), _seq(guide, KEY), _seq(guide, "[a-z]+")
    assert ff.drafts([free, open_], None) is None  # nothing forced: the plain step
    assert ff.drafts([free, open_], [[7, 8], []]) == [[7, 8], []]
    assert ff.drafts([free, keyed, open_], [[7, 8], [], []]) == \
        [[7, 8], keyed.req.constraint.forced()[:MAX_K], []]


def test_rows_with_attention_diagnostics_keep_the_whole_batch_plain(guide):
    ff = FastForward(max_seq_len=256)
    keyed, diag = _seq(guide, KEY), _seq(guide, None, attention=True)
    assert ff.drafts([keyed, diag], None) is None
    keyed.forced.append(5)  # feeding a prompt tail (for diagnostics)
    assert ff.drafts([keyed], None) is None


def test_batch_one_takes_the_whole_forced_run_whatever_was_measured():
    ff = FastForward(max_seq_len=256)
    ff.costs.plain_step(1, 0.010)
    ff.costs.verify_step(1, 17, 1.0)  # an absurdly slow call
    assert ff.cap(1, [12]) == 12


def test_an_unmeasured_batch_size_tries_the_whole_run():
    ff = FastForward(max_seq_len=256)
    assert ff.cap(8, [3, 12]) == 12
    ff.costs.plain_step(8, 0.010)
    assert ff.cap(8, [3, 12]) == 12  # (no verification measured yet)


def test_in_a_batch_the_length_follows_the_measured_cost_of_padding():
    """Batch 8, a plain step 10 ms: extra positions at 0.6 ms each (CPU-like: 17 positions a
    row ~9x a step) make one row's long run a loss but many rows' short runs a gain; at 0.01
    ms each (a device's) everything goes."""
    ff = FastForward(max_seq_len=256)
    ff.costs.plain_step(8, 0.010)
    ff.costs.verify_step(8, 17, 0.010 + 0.0006 * 8 * 16)
    assert ff.costs.relative(8, 17) == pytest.approx(8.68)
    assert ff.cap(8, [16]) == 0  # 24 tokens for ~8.7 steps' time: plain is better
    assert ff.costs.relative(8, 17) == pytest.approx(1 + 7.68 * _FORGET)  # measured again later
    assert ff.cap(8, [2] * 8) == 2  # 24 tokens in ~1.9 steps' time (interpolated)
    assert ff.cap(8, [2] * 7 + [16]) == 2  # (not padded to the long one)
    cheap = FastForward(max_seq_len=256)
    cheap.costs.plain_step(8, 0.010)
    cheap.costs.verify_step(8, 17, 0.010 + 0.00001 * 8 * 16)
    assert cheap.cap(8, [16, 3]) == 16


def test_a_refused_run_is_tried_again_after_some_steps():
    ff = FastForward(max_seq_len=256)
    ff.costs.plain_step(4, 0.010)
    ff.costs.verify_step(4, 9, 0.010 + 0.003 * 4 * 8)  # 3 ms an extra position: a loss for 8
    refusals = 0
    while not ff.cap(4, [8]) and refusals < 100:
        refusals += 1
    assert 5 <= refusals <= 40  # the estimate decays until the run is tried (and measured)


def test_k_max_is_bounded():
    with pytest.raises(ValueError, match="fast-forward tokens"):
        FastForward(256, k_max=MAX_K + 1)

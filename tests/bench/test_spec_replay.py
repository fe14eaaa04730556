"""bench/spec_replay.py: the engine's speculator replayed on given continuations and costs, and
the two measurements it replays with (greedy continuations, relative call costs)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvserve.bench import spec_replay as R

COSTS = {(1, S): 1.0 + 0.1 * (S - 1) for S in range(1, 10)}  # cheap extra positions (a big
DEAR = {(1, 1): 1.0, **{(1, S): 2.5 + 0.2 * S for S in range(2, 10)}}  # model) or dear ones


def test_a_looping_continuation_is_decoded_in_fewer_steps():
    prompt = [7, 8, 9, 10] * 8
    out = [7, 8, 9, 10] * 32  # the loop goes on: drafts after an 8-token match are right
    got = R.replay([prompt], [out], COSTS)
    assert got["tokens"] == len(out) - 1  # (the prefill's token is not a step's)
    assert got["tokens_per_step"] > 4 and got["speedup"] > 2.5
    assert got["acceptance"] > 0.9 and got["verification_steps"] > 0


def test_text_that_never_repeats_costs_little():
    rnd = random.Random(3)
    prompt = [rnd.randrange(1000) for _ in range(64)]
    out = [rnd.randrange(1000) for _ in range(128)]
    got = R.replay([prompt], [out], DEAR)
    assert 0.9 <= got["speedup"] <= 1.0 + 1e-9  # a few tried drafts, then plain steps
    assert got["tokens"] == 127


def test_dear_verification_takes_only_drafts_worth_it():
    """Echoes (a 1-token match, then a wrong guess) are not verified where a call of 2
    positions costs 2.9 plain steps; the loop at the end still is."""
    rnd = random.Random(5)
    prompt = [rnd.randrange(50) for _ in range(200)]
    out = [rnd.randrange(50) for _ in range(100)] + [1, 2, 3, 4] * 25
    got = R.replay([prompt], [out], DEAR)
    assert got["speedup"] > 1.2
    assert got["verification_steps"] < 40


def test_continuations_and_call_costs_on_the_tiny_artifact(artifact):
    from kvserve.bench.runner_kvserve import LoopRunner

    loop = LoopRunner(str(artifact.dir), threads=2)
    lm = loop.lm
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    outs = R.continuations(loop, prompts, 6)
    assert [len(o) for o in outs] == [6, 6]
    kv = lm.new_cache(1)  # the same tokens as the runner's own greedy loop
    logits = lm.prefill(kv, 0, [np.asarray(prompts[0])], last=True).logits[0][-1]
    assert outs[0][0] == int(logits.argmax())
    costs = R.call_costs(lm, prompts[0], 4, repeats=2, passes=1)
    assert sorted(costs) == [(1, 1), (1, 2), (1, 3), (1, 4)]
    assert costs[1, 1] == pytest.approx(1.0) and all(c > 0 for c in costs.values())
    batched = R.call_costs(lm, prompts[0], 3, repeats=2, passes=1, batch=2)
    assert sorted(batched) == [(n, S) for n in (1, 2) for S in (1, 2, 3)]
    assert batched[2, 1] == pytest.approx(1.0) and all(c > 0 for c in batched.values())


def _batch_costs(batch: int, fixed: float, per_row: float, per_position: float) -> dict:
    """A call's cost: a fixed part (reading the weights), and a part per row and position,
    over a plain call at ``batch`` rows."""
    def c(n, S):
        return fixed + per_row * n + per_position * n * (S - 1)
    return {(n, S): c(n, S) / c(batch, 1) for n in range(1, batch + 1) for S in range(1, 10)}


def test_a_batch_is_charged_by_its_rows_and_positions():
    """Four rows, one of which loops: its drafts are verified, it finishes early, and the
    other three go on in a smaller (cheaper) batch; with no drafts at all, plain steps."""
    rnd = random.Random(9)
    prompts, outs = [], []
    for b in range(4):
        prompts.append([rnd.randrange(1000) for _ in range(64)] if b else [1, 2, 3, 4] * 16)
        outs.append([rnd.randrange(1000) for _ in range(96)] if b else [1, 2, 3, 4] * 24)
    costs = _batch_costs(4, fixed=0.5, per_row=0.0625, per_position=0.01)
    got = R.replay(prompts, outs, costs, batch=4)
    assert got["tokens"] == 4 * 95 and got["verification_steps"] > 0
    # the loop done in a few verifications (1.4 plain steps each), then 3 rows at 0.92 of the
    # 4 rows' cost: 1.02
    assert 1.005 < got["speedup"] < 1.1
    plain = R.replay(prompts[1:], outs[1:], costs, batch=4)
    assert plain["steps"] == 95 and plain["speedup"] >= 0.97  # (a few tried drafts)


def test_a_batch_of_loops_is_sped_up():
    prompts = [[b, b + 1, b + 2] * 10 for b in range(0, 40, 10)]
    outs = [[b, b + 1, b + 2] * 30 for b in range(0, 40, 10)]
    got = R.replay(prompts, outs, _batch_costs(4, 1.0, 0.1, 0.02), batch=4)
    assert got["speedup"] > 3 and got["acceptance"] > 0.9


def test_the_bound_is_no_policy_below_it():
    """``oracle``: the cheapest path through the same drafts knowing their fate: never below
    the speculator's replay, 1.0 where nothing repeats, and a loop's whole draft at cheap
    costs (each 9-position call makes 9 tokens for 1.8 plain steps: 5x)."""
    rnd = random.Random(7)
    cases = [([7, 8, 9, 10] * 8, [7, 8, 9, 10] * 32),
             ([rnd.randrange(1000) for _ in range(64)], [rnd.randrange(1000) for _ in range(128)]),
             ([rnd.randrange(50) for _ in range(200)],
              [rnd.randrange(50) for _ in range(100)] + [1, 2, 3, 4] * 25)]
    for costs in (COSTS, DEAR):
        for prompt, out in cases:
            bound = R.oracle([prompt], [out], costs)["speedup"]
            assert bound >= R.replay([prompt], [out], costs)["speedup"] - 1e-9
            assert bound >= 1.0 - 1e-9
    assert R.oracle([cases[1][0]], [cases[1][1]], DEAR)["speedup"] == pytest.approx(1.0)
    loop = R.oracle([cases[0][0]], [cases[0][1]], COSTS)["speedup"]
    assert 4.5 < loop <= 127 / (127 / 9 * 1.8) + 1e-9


def test_one_length_per_match_length_sits_between_plain_steps_and_the_bound():
    """``by_length``: a loop's 8-token matches draft all 8 at cheap costs; text that never
    repeats drafts nothing (1.0); never above the bound."""
    rnd = random.Random(11)
    loop = ([7, 8, 9, 10] * 8, [7, 8, 9, 10] * 32)
    noise = ([rnd.randrange(1000) for _ in range(64)], [rnd.randrange(1000) for _ in range(128)])
    got = R.by_length([loop[0]], [loop[1]], COSTS)
    assert got["lengths"][8] == 8 and got["speedup"] > 4
    assert R.by_length([noise[0]], [noise[1]], DEAR)["speedup"] == pytest.approx(1.0)
    for costs in (COSTS, DEAR):
        both = R.by_length([loop[0], noise[0]], [loop[1], noise[1]], costs)["speedup"]
        assert both <= R.oracle([loop[0], noise[0]], [loop[1], noise[1]], costs)["speedup"] + 1e-9


def test_each_states_agreement_is_its_own_drafts():
    """``_agreements``: at each state the matched length and agreement of the draft proposed
    there (an index built afresh from the same tokens), not the state before's."""
    from kvserve.server.ngram import NgramIndex

    rnd = random.Random(13)
    prompt = [rnd.randrange(12) for _ in range(40)]
    out = [rnd.randrange(12) for _ in range(30)] + [1, 2, 3] * 10
    got = R._agreements(prompt, out, 8)
    for j, (n, m) in enumerate(got, start=1):
        index = NgramIndex(prompt + out[:j])
        draft = index.propose(8)
        assert (n, m) == (index.matched, R._agreeing(draft, out, j)), j

"""StepCosts: each verification shape's measured cost, and the prices of shapes not measured."""
import pytest

from kvserve.server.step_costs import PRIOR_PER_POSITION, StepCosts


def _costs(n=8, plain=0.010, calls=()):
    c = StepCosts()
    c.plain_step(n, plain)
    for S, seconds in calls:
        c.verify_step(n, S, seconds)
    return c


def test_nothing_measured_at_a_batch_size_is_priced_by_the_optimistic_prior():
    c = StepCosts()
    assert c.relative(8, 1) == 1.0
    assert c.relative(8, 5) == pytest.approx(1 + 4 * PRIOR_PER_POSITION)
    assert not c.measured(8)
    c.plain_step(8, 0.010)
    assert not c.measured(8) and c.relative(8, 5) == pytest.approx(1 + 4 * PRIOR_PER_POSITION)


def test_two_measured_shapes_draw_the_line_with_its_jump():
    """The 6M model at batch 8 (CPU, 2 cores): the jump from one position to two costs more
    than each one after it. Through S = 2 and S = 5 the line prices both as measured; a slope
    from S = 1 through S = 5 would price S = 2 at 1 + (3.67 - 1) / 4 = 1.67x."""
    c = _costs(calls=[(2, 0.0192), (5, 0.0367)])
    assert c.measured(8)
    assert c.relative(8, 2) == pytest.approx(1.92)
    assert c.relative(8, 5) == pytest.approx(3.67)
    assert c.relative(8, 3) == pytest.approx(1.92 + (3.67 - 1.92) / 3)  # between the two
    assert c.relative(8, 9) == pytest.approx(3.67 + 4 * (3.67 - 1.92) / 3)  # along the line
    assert c.relative(4, 2) == pytest.approx(1 + PRIOR_PER_POSITION)  # other batch sizes: own


def test_the_line_fits_every_measured_shape_weighed_by_its_calls():
    """The 6M model at batch 8: S = 2 .. 5 at 1.92, 2.62, 3.15, 3.67 plain steps (a line with a
    jump, as measured); each shape's figure is the line's, not its own median."""
    measured = {2: 1.92, 3: 2.62, 4: 3.15, 5: 3.67}
    c = _costs(plain=0.010, calls=[(S, r * 0.010) for S, r in measured.items() for _ in range(9)])
    for S, r in measured.items():
        assert c.relative(8, S) == pytest.approx(r, abs=0.08)
    assert c.relative(8, 2) > 1.85  # the jump kept: not a slope from S = 1


def test_one_dear_early_call_does_not_keep_a_shape_out():
    """The default trained model at batch 1: S = 2 measured once at 2.4x while the process
    warmed, the shapes taken since at 1.6, 1.9 and 2.2x (9 calls each). Priced by its own
    median, S = 2 was refused ever after (and so never measured again); on the line, the other
    shapes' calls pull its price down (to where drafts take it again), and its own next calls
    the rest of the way."""
    c = _costs(n=1, plain=0.001, calls=[(2, 0.0024)] + [
        (S, r * 0.001) for S, r in ((3, 1.6), (4, 1.9), (5, 2.2)) for _ in range(9)])
    assert c.relative(1, 2) < 1.6
    for _ in range(4):
        c.verify_step(1, 2, 0.0013)
    assert c.relative(1, 2) == pytest.approx(1.3, abs=0.02)
    assert c.relatives(1, 5) == [c.relative(1, S) for S in range(1, 6)]


def test_the_median_of_recent_calls_ignores_one_stalled_call():
    c = _costs(calls=[(3, 0.015)] * 5 + [(3, 0.200)] + [(3, 0.016)] * 3)
    assert c.relative(8, 3) == pytest.approx(1.5)
    for _ in range(9):  # the shape got dearer for good: 9 newer calls replace the figure
        c.verify_step(8, 3, 0.030)
    assert c.relative(8, 3) == pytest.approx(3.0)


def test_a_call_is_measured_against_the_plain_step_of_its_time():
    c = _costs(plain=0.010, calls=[(2, 0.015)])
    for _ in range(40):  # the machine slows down by half ...
        c.plain_step(8, 0.020)
    c.verify_step(8, 4, 0.040)  # ... and a call then costs 2x a plain step, not 4x
    assert c.relative(8, 4) == pytest.approx(2.0, rel=1e-3)  # (the EMA after 40 steps)
    assert c.relative(8, 2) == pytest.approx(1.5)


def test_below_a_single_measured_shape_the_price_runs_from_one_plain_step():
    c = _costs(calls=[(9, 0.050)])
    assert c.relative(8, 5) == pytest.approx(1 + 4 * (5.0 - 1) / 8)
    assert c.relative(8, 17) == pytest.approx(5.0 + 8 * (5.0 - 1) / 8)


def test_forget_shrinks_every_shape_beyond_a_plain_step():
    c = _costs(calls=[(2, 0.020), (5, 0.040)])
    c.forget(8, 0.5)
    assert c.relative(8, 2) == pytest.approx(1.5)
    assert c.relative(8, 5) == pytest.approx(2.5)
    c.forget(4, 0.5)  # nothing measured there: nothing to do
    assert c.relative(8, 2) == pytest.approx(1.5)


def test_a_noisy_cheaper_longer_shape_never_prices_below_one_step():
    c = _costs(calls=[(2, 0.013), (3, 0.011)])  # (noise: S = 3 measured cheaper than S = 2)
    assert c.relative(8, 6) >= 1.0
    assert c.relative(8, 3) == pytest.approx(1.2)  # no slope down: flat at their mean
    assert c.relative(8, 2) == pytest.approx(1.2)


def test_a_plain_step_after_a_change_of_shape_is_not_the_reference():
    """The first plain call after a verification (or at a new batch size) pays for the change
    of shape: only a plain step after a plain step at the same batch size is measured."""
    c = _costs(plain=0.010)
    c.verify_step(8, 3, 0.020)
    assert c.plain_step(8, 0.015) is False and c.plain[8] == pytest.approx(0.010)
    assert c.plain_step(8, 0.010) is True
    assert c.plain_step(4, 0.007) is False and 4 not in c.plain  # (8 -> 4 rows)
    assert c.plain_step(4, 0.006) is True and c.plain[4] == pytest.approx(0.006)
    assert StepCosts().plain_step(2, 0.005) is True  # the engine's first step


def test_relatives_are_relative_at_every_length():
    """``relatives(n, top)``, what the speculator weighs every length with in one call, is
    ``relative(n, S)`` for S = 1 .. top: the fitted line's, or the prior."""
    c = StepCosts()
    assert c.relatives(8, 4) == [c.relative(8, S) for S in range(1, 5)]  # the prior
    for _ in range(3):
        c.plain_step(8, 0.001)
    for S, seconds in ((2, 0.0019), (5, 0.0037), (3, 0.0024)):
        c.verify_step(8, S, seconds)
        c.plain_step(8, 0.001)
        c.plain_step(8, 0.001)
    got = c.relatives(8, 12)
    assert got == [c.relative(8, S) for S in range(1, 13)]
    # the least-squares line through (S - 2, r) = (0, 1.9), (1, 2.4), (3, 3.7), one call each
    b = (-4 / 3 * -(2.6667 - 1.9) + -1 / 3 * -(2.6667 - 2.4) + 5 / 3 * (3.7 - 2.6667)) / (42 / 9)
    assert got[0] == 1.0 and got[1] == pytest.approx(8 / 3 - 4 / 3 * b, abs=1e-3)
    assert got[4] == pytest.approx(got[1] + 3 * b)
    assert got == sorted(got)  # (these measurements grow with S: so does the line)


def test_a_call_that_paid_a_one_time_cost_is_not_counted():
    """The first call of a shape builds its IO binding (and is onnxruntime's first run of that
    shape): on the trained model such calls measured 2.5-3.4 plain steps where the same
    shape's later calls took 1.2-1.4. Taken as the shape's figure, one such sample kept it
    out of use; ``once`` calls leave the figures as they were."""
    c = StepCosts()
    c.plain_step(8, 0.001)
    c.plain_step(8, 0.005, once=True)  # (a steady step, but it built a binding)
    assert c.plain[8] == 0.001
    c.verify_step(8, 3, 0.004, once=True)
    assert c.ratio.get(8, {}).get(3) is None and not c.measured(8)
    c.plain_step(8, 0.001)  # (the first plain step after a verification: not steady)
    c.plain_step(8, 0.001)
    c.verify_step(8, 3, 0.0013)
    assert c.relative(8, 3) == pytest.approx(1.3)


def test_the_prices_follow_every_new_call_and_forget():
    """``relatives`` keeps its list between calls: a new measurement, or ``forget``, must
    change what it returns, at every length asked."""
    c = _costs(calls=[(2, 0.015), (5, 0.030)])
    before = c.relatives(8, 9)
    assert before == [c.relative(8, S) for S in range(1, 10)]
    for _ in range(9):
        c.verify_step(8, 5, 0.040)
    after = c.relatives(8, 12)
    assert after[4] > before[4] and after == [c.relative(8, S) for S in range(1, 13)]
    c.forget(8, 0.5)
    assert c.relatives(8, 3) == [c.relative(8, S) for S in range(1, 4)]
    assert c.relatives(8, 3)[2] < after[2]


def test_a_shape_shorter_than_any_measured_is_never_priced_free():
    """Only S = 4 (1.3x) and S = 5 (1.9x) measured: their line runs under 1.0 at S = 2 and 3;
    those are priced on the straight line from one plain step to S = 4's price instead."""
    c = _costs(plain=0.010, calls=[(4, 0.013), (5, 0.019)])
    got = c.relatives(8, 6)
    assert got[1] == pytest.approx(1 + 0.3 / 3) and got[2] == pytest.approx(1 + 0.6 / 3)
    assert got[3] == pytest.approx(1.3) and got[4] == pytest.approx(1.9)
    assert got == [c.relative(8, S) for S in range(1, 7)] and got == sorted(got)

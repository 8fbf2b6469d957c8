"""planning/measure.py: a candidate's measurement, its recorded costs against its timed step."""

from __future__ import annotations

import pytest

from gpipe_fast.planning.measure import Measurement
from gpipe_fast.planning.predict import StageCosts


def measurement(makespan: float) -> Measurement:
    costs = [StageCosts(0.01, 0.02, 0.01, 0.01, 0.001, 0.008), StageCosts(0.02, 0.04)]
    return Measurement(seconds=0.5, costs=costs, makespan=makespan)


def test_recorded_steps_slower_than_the_timed_step_are_scaled_down_to_it() -> None:
    slow = measurement(0.40)
    timed = slow.timed_at(0.30)
    assert timed.seconds == 0.30 and timed.makespan == pytest.approx(0.30)
    assert timed.call == 0.0
    for before, after in zip(slow.costs, timed.costs, strict=True):
        assert after.forward == pytest.approx(before.forward * 0.75)
        assert after.backward == pytest.approx(before.backward * 0.75)
        assert after.backward_weight == pytest.approx(before.backward_weight * 0.75)
        assert after.loss == pytest.approx(before.loss * 0.75)
    assert timed.costs[0].forward_no_grad == pytest.approx(0.006)
    assert timed.costs[1].forward_no_grad is None


def test_recorded_steps_faster_than_the_timed_step_keep_their_costs() -> None:
    fast = measurement(0.20)
    timed = fast.timed_at(0.30)
    assert timed.costs == fast.costs and timed.makespan == 0.20
    assert timed.call == pytest.approx(0.10)  # the step's time around its tasks

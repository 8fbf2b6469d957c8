"""Plans calibrated from recorded steps: costs read from spans, the hand-off cost solved
through the simulator, and gf.plan(calibrate=...) end to end."""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.planning.calibrate import (
    calibrated,
    call_cost,
    checkpoint_of,
    handoff_cost,
    measured_stage_costs,
)
from gpipe_fast.planning.predict import StageCosts, task_costs
from gpipe_fast.runtime.timeline import TaskSpan, Timeline


def _span(kind: str, cell: int, microbatch: int, start: float, duration: float) -> TaskSpan:
    return TaskSpan("step", kind, cell, microbatch, start, start + duration, worker=cell)


def test_costs_are_each_cells_median_per_action() -> None:
    spans = [_span("forward", 0, m, 10.0 * m, d) for m, d in enumerate([1.0, 3.0, 2.0])]
    spans += [_span("backward", 0, m, 50.0 + 10 * m, d) for m, d in enumerate([4.0, 8.0, 6.0])]
    spans += [_span("forward", 1, m, 5.0 + 10 * m, 0.5) for m in range(3)]
    spans += [_span("loss", 1, m, 6.0 + 10 * m, 0.25) for m in range(3)]
    spans += [_span("backward_input", 1, m, 40.0 + 10 * m, 1.5) for m in range(3)]
    spans += [_span("backward_weight", 1, m, 45.0 + 10 * m, 2.5) for m in range(3)]
    timeline = Timeline(cells=2, microbatches=3, spans=spans, workers=2)
    first, last = measured_stage_costs([timeline], 2)
    # An unsplit backward stands for its halves; halves add up to a backward.
    assert first == StageCosts(forward=2.0, backward=6.0, backward_input=3.0, backward_weight=3.0)
    assert last == StageCosts(0.5, 4.0, 1.5, 2.5, loss=0.25)


def _recorded(schedule: _C.Schedule, costs: Sequence[StageCosts], handoff: float) -> Timeline:
    """The timeline a step would leave whose tasks took `costs` and each waited `handoff`
    before starting (the runtime's wake-up, outside the task's span)."""
    base = task_costs(schedule, costs, 0.0)
    simulated = _C.simulate(schedule, [c + handoff for c in base])
    spans = [
        TaskSpan(
            "step",
            task.action_name,
            task.stage,
            task.microbatch,
            start + handoff,
            end,
            worker=task.worker,
        )
        for task, start, end in zip(schedule.tasks, simulated.start, simulated.end, strict=True)
    ]
    return Timeline(2, schedule.microbatches, spans, workers=2, schedule="1f1b")


def test_the_handoff_is_what_makes_the_simulated_step_as_long_as_the_recorded_one() -> None:
    costs = [StageCosts(1.0, 2.0, loss=0.1), StageCosts(1.5, 3.0, loss=0.1)]
    schedule = _C.make_schedule("1f1b", 2, 2, 6, "never")
    recorded = _recorded(schedule, costs, handoff=0.2)
    solved = handoff_cost(recorded, costs)
    with_solved = _C.simulate(schedule, task_costs(schedule, costs, solved)).makespan
    assert with_solved == pytest.approx(recorded.makespan, rel=1e-6)
    # The first task's wait lies before the first span, so the recorded step is one hand-off
    # short of the simulated one: the solution is a little under the truth, never over.
    assert 0.15 < solved <= 0.2


def test_a_step_with_no_time_between_its_tasks_has_no_handoff() -> None:
    costs = [StageCosts(1.0, 2.0), StageCosts(1.0, 2.0)]
    schedule = _C.make_schedule("1f1b", 2, 2, 4, "never")
    assert handoff_cost(_recorded(schedule, costs, handoff=0.0), costs) == 0.0


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)])


def _record(pipe: gf.GPipe, x: torch.Tensor, steps: int) -> list[Timeline]:
    pipe.record_timeline()
    out = []
    for _ in range(steps):
        pipe.train_step(x, x, nn.functional.mse_loss)
        out.append(pipe.timeline())
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_plan_predicts_any_schedule_from_recorded_fill_drain(make_pipe: Any, schedule: str) -> None:
    model, x = _model(), torch.randn(16, 16)
    pipe = make_pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint="never")
    timelines = _record(pipe, x, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = gf.plan(model, x, 2, 4, balance=[2, 2], schedule=schedule, calibrate=timelines)
    # Zero bubble from unsplit backwards is an estimate, and the plan says so.
    warned = [w for w in caught if "calibrate from a zero_bubble step" in str(w.message)]
    assert len(warned) == (1 if schedule == "zero_bubble" else 0)
    calibration = calibrated(timelines, 2, 4)
    costs, handoff, call = calibration.costs, calibration.handoff, calibration.call
    assert not calibration.split
    # The plan is the schedule simulated with the recorded costs and the solved hand-off,
    # plus what each call spent around its tasks.
    steps = _C.make_schedule(schedule, 2, 2, 4, "never")
    want = _C.simulate(steps, task_costs(steps, costs, handoff)).makespan + call
    assert plan.calibrated and plan.schedule == schedule
    assert plan.call_overhead == call > 0.0
    assert plan.step_time == pytest.approx(want)
    assert plan.overhead == handoff >= 0.0
    assert [c.cost for c in plan.cells] == pytest.approx([c.forward + c.backward for c in costs])
    assert "calibrated from recorded steps" in str(plan)


def test_zero_bubble_calibrated_from_its_own_steps_uses_the_measured_halves(make_pipe: Any) -> None:
    model, x = _model(), torch.randn(16, 16)
    pipe = make_pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4, schedule="zero_bubble")
    timelines = _record(pipe, x, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = gf.plan(model, x, 2, 4, balance=[2, 2], schedule="zero_bubble", calibrate=timelines)
    calibration = calibrated(timelines, 2, 4)
    costs = calibration.costs
    assert calibration.split
    halves = [s for t in timelines for s in t.spans if s.kind == "backward_weight" and s.cell == 0]
    assert len(halves) == 2 * 4
    assert costs[0].backward_weight == statistics.median(s.duration_s for s in halves)
    assert costs[0].backward == costs[0].backward_input + costs[0].backward_weight
    assert plan.calibrated


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_one_recorded_step_calibrates_a_plan_that_reproduces_it(
    make_pipe: Any, checkpoint: str
) -> None:
    model, x = _model(), torch.randn(16, 16)
    pipe = make_pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
    (timeline,) = _record(pipe, x, 1)
    assert checkpoint_of(timeline) == checkpoint
    plan = gf.plan(model, x, 2, 4, balance=[2, 2], checkpoint=checkpoint, calibrate=timeline)
    if plan.overhead > 0:  # solved so that the simulated step is the recorded call
        assert plan.step_time == pytest.approx(timeline.call_s, rel=1e-6)
    else:  # the recorded tasks alone already fill the step
        assert plan.step_time >= timeline.call_s * (1 - 1e-9)


def test_a_train_step_records_how_long_its_call_took(make_pipe: Any) -> None:
    model, x = _model(), torch.randn(16, 16)
    pipe = make_pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4)
    (step,) = _record(pipe, x, 1)
    nn.functional.mse_loss(pipe(x), x).backward()
    by_pipe_call = pipe.timeline()
    assert step.call_s > step.makespan > 0
    assert call_cost(step) == pytest.approx(step.call_s - step.makespan)
    assert by_pipe_call.call_s == 0.0 and call_cost(by_pipe_call) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "calibrate: pass balance="),
        ({"balance": [2, 2], "cost": "size"}, ValueError, "calibrate: calibrating measures time"),
        ({"balance": [1, 1, 2], "partitions": 3}, ValueError, "timeline of 2 cells"),
        ({"balance": [2, 2], "chunks": 2}, ValueError, "timeline of 4 micro-batches"),
        ({"balance": [2, 2], "calibrate": []}, TypeError, "calibrate: expected a gf.Timeline"),
        ({"balance": [2, 2], "calibrate": "step.json"}, TypeError, "calibrate: expected"),
    ],
)
def test_bad_calibration_is_refused_by_name(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    model, x = _model(), torch.randn(16, 16)
    spans = [_span("forward", c, m, 0.0, 1.0) for c in range(2) for m in range(4)]
    args: dict[str, object] = {
        "partitions": 2,
        "chunks": 4,
        "calibrate": Timeline(cells=2, microbatches=4, spans=spans, workers=2),
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        gf.plan(model, x, **args)  # type: ignore[arg-type]

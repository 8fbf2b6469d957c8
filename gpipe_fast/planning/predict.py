"""Predicts a training step's time and bubble per schedule.

The native simulator runs over per-micro-batch task costs, plus the runtime's own cost per
task (measured by planning/overhead.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpipe_fast import _C


@dataclass(frozen=True)
class StageCosts:
    """Seconds (or any unit) of one micro-batch's tasks on one stage."""

    forward: float
    backward: float
    backward_input: float = 0.0  # the zero-bubble halves of `backward`
    backward_weight: float = 0.0
    loss: float = 0.0  # the last stage's loss


@dataclass(frozen=True)
class Prediction:
    step_time: float  # the simulated makespan
    forward_time: float  # when the last forward ends
    bubble: float  # idle share of worker-time
    start: tuple[float, ...] = ()  # each task's simulated start and end
    end: tuple[float, ...] = ()


def task_costs(schedule: _C.Schedule, costs: Sequence[StageCosts], overhead: float) -> list[float]:
    """Each task's cost: its stage's cost of its action's cost class (the StageCosts field
    of that name: a recompute costs a forward; communication nothing), plus the runtime's
    `overhead` per task."""
    classes = [fact.cost for fact in _C.action_facts()]
    out = []
    for task in schedule.tasks:
        cost_class = classes[task.action]
        cost = 0.0 if cost_class == "none" else getattr(costs[task.stage], cost_class)
        out.append(cost + overhead)
    return out


def predict(
    schedule: _C.Schedule, costs: Sequence[StageCosts], overhead: float = 0.0
) -> Prediction:
    """The schedule simulated with `costs` per stage and `overhead` per task."""
    if len(costs) != schedule.stages:
        raise ValueError(f"costs: got {len(costs)} stages' costs for {schedule.stages} stages")
    timeline = _C.simulate(schedule, task_costs(schedule, costs, overhead))
    forward = _C.actions().index("forward")
    ends = [
        end
        for task, end in zip(schedule.tasks, timeline.end, strict=True)
        if task.action == forward
    ]
    return Prediction(timeline.makespan, max(ends, default=0.0), timeline.bubble,
                      tuple(timeline.start), tuple(timeline.end))  # fmt: skip

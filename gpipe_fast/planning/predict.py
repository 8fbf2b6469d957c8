"""Predicts a training step's time and bubble per schedule.

The native simulator runs over per-micro-batch task costs, plus the runtime's own cost per
task (measured by planning/overhead.py)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from gpipe_fast import _C
from gpipe_fast.schedule.registry import recomputed


@dataclass(frozen=True)
class StageCosts:
    """Seconds (or any unit) of one micro-batch's tasks on one stage."""

    forward: float
    backward: float
    backward_input: float = 0.0  # the zero-bubble halves of `backward`
    backward_weight: float = 0.0
    loss: float = 0.0  # the last stage's loss
    # The forward of a checkpointed micro-batch, which keeps no graph (None: as `forward`).
    forward_no_grad: float | None = None

    def scaled(self, factor: float) -> StageCosts:
        """These costs times `factor`."""
        no_grad = None if self.forward_no_grad is None else self.forward_no_grad * factor
        return StageCosts(self.forward * factor, self.backward * factor,
                          self.backward_input * factor, self.backward_weight * factor,
                          self.loss * factor, no_grad)  # fmt: skip


@dataclass(frozen=True)
class Prediction:
    step_time: float  # the simulated makespan
    forward_time: float  # when the last forward ends
    bubble: float  # idle share of worker-time
    start: tuple[float, ...] = ()  # each task's simulated start and end
    end: tuple[float, ...] = ()


def task_costs(
    schedule: _C.Schedule,
    costs: Sequence[StageCosts],
    overhead: float,
    checkpointed: Collection[tuple[int, int]] | None = None,
) -> list[float]:
    """Each task's cost: its stage's cost of its action's cost class (the StageCosts field
    of that name: a recompute costs a forward; communication nothing), plus the runtime's
    `overhead` per task. The forward of a checkpointed (stage, micro-batch) costs the
    stage's forward_no_grad where given; `checkpointed`: those pairs, by default the ones
    the schedule recomputes."""
    classes = [fact.cost for fact in _C.action_facts()]
    forward = _C.actions().index("forward")
    if all(c.forward_no_grad is None for c in costs):
        checkpointed = ()
    elif checkpointed is None:
        flags = recomputed(schedule)
        checkpointed = {(k, m) for k, row in enumerate(flags) for m, flag in enumerate(row) if flag}
    out = []
    for task in schedule.tasks:
        cost_class = classes[task.action]
        stage = costs[task.stage]
        if cost_class == "none":
            cost = 0.0
        elif task.action == forward and (task.stage, task.microbatch) in checkpointed:
            cost = stage.forward if stage.forward_no_grad is None else stage.forward_no_grad
        else:
            cost = getattr(stage, cost_class)
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

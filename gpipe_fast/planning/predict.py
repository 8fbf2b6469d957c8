"""Predicts a training step's time and bubble per schedule.

The native simulator runs over per-micro-batch task costs, plus the runtime's own cost per
task, measured."""

from __future__ import annotations

import statistics
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

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


def task_overhead(
    stages: int, workers: int, chunks: int, schedule: str, *, steps: int = 30, mean: bool = False
) -> float:
    """The runtime's seconds per task, measured: a train_step through `stages` cells that do
    nothing (nn.Identity) on CPU, its median time divided by the makespan its schedule would
    have with one unit per task. Covers what every task pays whatever the layers: the
    executor's hand-offs, the Python task body, the autograd engine's entry. `mean`: the
    steps' mean instead of their median (stalls counted at their rate)."""
    from gpipe_fast.api.gpipe import GPipe  # a pipe depends on this module's package

    devices = ["cpu"] * workers
    pipe = GPipe(
        nn.Sequential(*[nn.Identity() for _ in range(stages)]),
        [1] * stages,
        devices=devices,
        chunks=chunks,
        checkpoint="never",
        schedule=schedule,
    )
    try:
        x = torch.randn(chunks, 4, requires_grad=True)

        def step() -> None:
            pipe.train_step(x, x, lambda out, target: out.sum())

        for _ in range(3):
            step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        unit = _C.make_schedule(schedule, stages, workers, chunks, "never")
        makespan = _C.simulate(unit, [1.0] * len(unit.tasks)).makespan
        return (statistics.fmean(times) if mean else statistics.median(times)) / makespan
    finally:
        pipe.close()

"""Stage costs and the runtime's hand-off cost per task, read from recorded steps' timelines.

A plan can then predict other schedules from the step as it really ran."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpipe_fast import _C
from gpipe_fast.planning.predict import StageCosts, task_costs
from gpipe_fast.runtime.timeline import Timeline
from gpipe_fast.schedule.registry import communication_actions

# Bisection steps for the hand-off cost: 40 halvings of a bound that is at most the step.
_SEARCH_STEPS = 40


def check_timelines(
    calibrate: Timeline | Sequence[Timeline], cells: int, chunks: int
) -> list[Timeline]:
    """The recorded steps as a list, each checked to fit a plan of `cells` and `chunks`."""
    timelines = [calibrate] if isinstance(calibrate, Timeline) else list(calibrate)
    if not timelines or not all(isinstance(t, Timeline) for t in timelines):
        raise TypeError("calibrate: expected a gf.Timeline (pipe.timeline()) or a list of them")
    communication = communication_actions()
    for timeline in timelines:
        if timeline.cells != cells:
            raise ValueError(
                f"calibrate: a timeline of {timeline.cells} cells cannot calibrate a plan of "
                f"{cells} partitions"
            )
        if timeline.microbatches != chunks:
            raise ValueError(
                f"calibrate: a timeline of {timeline.microbatches} micro-batches cannot "
                f"calibrate a plan of {chunks} chunks"
            )
        if any(s.kind in communication for s in timeline.spans):
            raise ValueError("calibrate: a multi-process rank's timeline holds one rank only")
        if not any(s.kind == "forward" for s in timeline.spans):
            raise ValueError("calibrate: the timeline has no forward task (record a step)")
    return timelines


def measured_stage_costs(timelines: Sequence[Timeline], cells: int) -> list[StageCosts]:
    """Each stage's median task duration per action over the timelines' spans. A backward not
    split in halves stands for both (each half taken as half of it) and the other way round;
    a loss never recorded (pipe(x): the loss is the caller's) costs nothing."""
    found = cell_costs(timelines, range(cells))
    return [found[cell] for cell in range(cells)]


def cell_costs(timelines: Sequence[Timeline], cells: Iterable[int]) -> dict[int, StageCosts]:
    """measured_stage_costs of the given cells only (a rank's own, across processes)."""

    def median(cell: int, action: str) -> float | None:
        durations = [
            s.duration_s for t in timelines for s in t.spans if s.cell == cell and s.kind == action
        ]
        return statistics.median(durations) if durations else None

    costs = {}
    for cell in cells:
        forward = median(cell, "forward")
        if forward is None:
            raise ValueError(f"calibrate: no forward of cell {cell} in the timelines")
        backward = median(cell, "backward")
        halves = median(cell, "backward_input"), median(cell, "backward_weight")
        if backward is None:
            if halves[0] is None:
                raise ValueError(f"calibrate: no backward of cell {cell} in the timelines")
            backward = halves[0] + (halves[1] or 0.0)
        costs[cell] = StageCosts(
            forward=forward,
            backward=backward,
            backward_input=backward / 2 if halves[0] is None else halves[0],
            backward_weight=backward / 2 if halves[1] is None else halves[1],
            loss=median(cell, "loss") or 0.0,
        )
    return costs


def handoff_cost(timeline: Timeline, costs: Sequence[StageCosts]) -> float:
    """The runtime's seconds per task outside the tasks' own spans (wake-ups, dependency
    hand-offs): the cost that, added to every task of the recorded schedule simulated with
    `costs`, gives the step's recorded makespan."""
    checkpoint = checkpoint_of(timeline)
    schedule = _C.make_schedule(
        timeline.schedule, timeline.cells, timeline.rows, timeline.microbatches, checkpoint
    )
    return solve_handoff(schedule, costs, timeline.makespan)


def solve_handoff(schedule: _C.Schedule, costs: Sequence[StageCosts], target: float) -> float:
    """The cost that, added to every task of `schedule` simulated with `costs`, makes it
    last `target` seconds (0 when it lasts that long without)."""
    base = task_costs(schedule, costs, 0.0)

    def makespan(overhead: float) -> float:
        return _C.simulate(schedule, [c + overhead for c in base]).makespan

    low, high = 0.0, target / max(len(base), 1)
    if makespan(low) >= target:
        return 0.0  # the step ran no slower than its tasks: nothing to add
    while makespan(high) < target:  # a task alone may run longer than its span suggests
        high *= 2
    for _ in range(_SEARCH_STEPS):
        middle = (low + high) / 2
        if makespan(middle) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def checkpoint_of(timeline: Timeline) -> str:
    """The checkpoint mode whose recomputes the timeline shows."""
    recomputes = sum(1 for s in timeline.spans if s.kind == "recompute")
    if recomputes == 0:
        return "never"
    return "always" if recomputes >= timeline.cells * timeline.microbatches else "except_last"


def call_cost(timeline: Timeline) -> float:
    """Seconds a train_step call spent around its tasks (splitting the batch, gathering the
    loss, accumulating input gradients); 0 when the call was not timed (pipe(x))."""
    return max(0.0, timeline.call_s - timeline.makespan) if timeline.call_s > 0 else 0.0


@dataclass(frozen=True)
class Calibration:
    """What recorded steps say of the pipe that ran them: medians over the steps."""

    costs: list[StageCosts]  # per stage
    handoff: float  # seconds per task between tasks
    call: float  # seconds per train_step call around its tasks
    split: bool  # whether the backwards were recorded split (zero bubble's halves measured)


def calibrated(calibrate: Timeline | Sequence[Timeline], cells: int, chunks: int) -> Calibration:
    """The calibration that recorded steps give a plan of `cells` and `chunks`."""
    timelines = check_timelines(calibrate, cells, chunks)
    costs = measured_stage_costs(timelines, cells)
    return Calibration(
        costs=costs,
        handoff=statistics.median(handoff_cost(t, costs) for t in timelines),
        call=statistics.median(call_cost(t) for t in timelines),
        split=any(s.kind == "backward_input" for t in timelines for s in t.spans),
    )

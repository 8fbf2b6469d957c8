"""The demo's step breakdown: exact figures on a made-up timeline, consistent ones on a real
step, the cells timed alone, and a verdict that never hides a loss."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.demo import alone as alone
from gpipe_fast.demo import report as report
from gpipe_fast.planning.predict import StageCosts
from gpipe_fast.runtime.timeline import TaskSpan, Timeline
from gpipe_fast.schedule.registry import actions, builtin_schedules, ideal_bubble

SCHEDULES = builtin_schedules()

# Task ids follow _C.gpipe_forward(2, 2) and _C.gpipe_backward(2, 2, [True, False]):
# forward 0: F(0,0), 1: F(0,1), 2: F(1,0) after 0, 3: F(1,1) after 1; backward (each cell
# recomputes micro-batch 0 ahead, while micro-batch 1's gradient is on its way) 0: R(0,0),
# 1: B(0,1) after 4, 2: B(0,0) after 5, 3: R(1,0), 4: B(1,1), 5: B(1,0).
_SPANS = [
    TaskSpan("forward", "forward", 0, 0, 0.0, 1.0, task=0),
    TaskSpan("forward", "forward", 0, 1, 1.0, 2.0, task=1),
    TaskSpan("forward", "forward", 1, 0, 1.5, 2.5, task=2),  # 0.5 s after F(0,0) ended
    TaskSpan("forward", "forward", 1, 1, 2.5, 3.5, task=3),
    TaskSpan("backward", "recompute", 1, 0, 10.0, 11.0, task=3),
    TaskSpan("backward", "backward", 1, 1, 11.0, 13.0, task=4),
    TaskSpan("backward", "backward", 1, 0, 13.0, 15.0, task=5),
    TaskSpan("backward", "recompute", 0, 0, 10.0, 11.0, task=0),
    TaskSpan("backward", "backward", 0, 1, 13.0, 15.0, task=1),
    TaskSpan("backward", "backward", 0, 0, 15.25, 17.25, task=2),  # 0.25 s after B(1,0)
]
_ALONE = StageCosts(forward=0.8, backward=1.6, forward_no_grad=0.5)


def _made_up() -> Timeline:
    return Timeline(cells=2, microbatches=2, spans=list(_SPANS))


def test_checkpointed_microbatches_are_those_recomputed() -> None:
    assert _made_up().checkpointed() == {(0, 0), (1, 0)}


def test_handoffs_are_starts_after_the_inputs_and_the_cell_were_ready() -> None:
    assert _made_up().handoffs() == pytest.approx([0.25, 0.5])


def test_breakdown_splits_the_makespan_exactly() -> None:
    timeline = _made_up()
    workers = report.breakdown(timeline, [_ALONE, _ALONE], threads=1)
    assert timeline.makespan == pytest.approx(3.5 + 7.25)
    # Each cell: F checkpointed 0.5 + F 0.8 + 2 B 1.6 = 4.5 s compute, one R 0.8 s; its
    # spans take 7 s, so 1.7 s of overhead inside them, plus its hand-offs.
    for k, (cell, handoff) in enumerate(zip(workers, (0.25, 0.5), strict=True)):
        assert (cell.worker, cell.cells, cell.threads, cell.tasks) == (k, (k,), 1, 5)
        assert cell.compute_s == pytest.approx(4.5)
        assert cell.recompute_s == pytest.approx(0.8)
        assert cell.span_overhead_s == pytest.approx(1.7)
        assert cell.handoff_s == pytest.approx(handoff)
        assert cell.idle_s == pytest.approx(10.75 - 4.5 - 0.8 - 1.7 - handoff)
    # The measured bubble is what the cells did not spend in tasks: hand-offs and idle.
    idle = report.total_share(workers, lambda c: c.handoff_s + c.idle_s)
    assert idle == pytest.approx(timeline.bubble())


def test_breakdown_never_reports_negative_overhead() -> None:
    slow_alone = StageCosts(forward=5.0, backward=5.0, forward_no_grad=5.0)
    cells = report.breakdown(_made_up(), [slow_alone, slow_alone], threads=None)
    for cell in cells:
        assert cell.span_overhead_s == 0.0
        # The compute is capped at what the spans took, so the parts still add up.
        assert cell.compute_s + cell.recompute_s == pytest.approx(7.0)
        parts = cell.compute_s + cell.recompute_s + cell.overhead_s + cell.idle_s
        assert parts == pytest.approx(cell.makespan_s)


def test_simulated_bubble_of_equal_cells_is_the_fill_drain_bubble() -> None:
    spans = [s for s in _SPANS if s.kind != "recompute"]  # as if checkpoint="never"
    timeline = Timeline(cells=2, microbatches=2, spans=spans)
    assert report.simulated_bubble(timeline, [_ALONE, _ALONE]) == pytest.approx(
        timeline.ideal_bubble
    )
    slower_last = StageCosts(forward=1.6, backward=3.2, forward_no_grad=1.0)
    assert report.simulated_bubble(timeline, [_ALONE, slower_last]) > timeline.ideal_bubble


def _cells_of(share: dict[str, float]) -> list[report.WorkerBreakdown]:
    return [
        report.WorkerBreakdown(
            worker=0,
            cells=(0,),
            threads=1,
            tasks=10,
            makespan_s=1.0,
            compute_s=share["compute"],
            recompute_s=share["recompute"],
            span_overhead_s=share["overhead"],
            handoff_s=0.0,
        )
    ]


@pytest.mark.parametrize("on_cpu", [True, False])
def test_the_verdict_says_slower_and_why_when_slower(on_cpu: bool) -> None:
    cells = _cells_of({"compute": 0.6, "recompute": 0.2, "overhead": 0.05})
    comparison = report.Comparison(0.8, "all cores", 0.4, cells, on_cpu=on_cpu)
    verdict = comparison.verdict()
    assert "slower here (0.80x the plain model)" in verdict
    # The work per cell (0.8 s) against the plain model's (0.4 s), then what the pipe adds.
    assert "takes 800.00 ms (2.00x the plain model's 400.00 ms" in verdict
    assert "included, 20.0% of cell time" in verdict
    assert "imbalance: 15.0% of cell time) and overhead (5.0%)" in verdict
    assert "does not fit one device" in verdict
    assert ("on one CPU" in verdict) == on_cpu
    assert ("Its one cell uses the cores" in verdict) == on_cpu  # _cells_of makes one cell


@pytest.mark.parametrize("on_cpu", [True, False])
def test_the_verdict_says_faster_and_why_only_when_the_work_explains_it(on_cpu: bool) -> None:
    cells = _cells_of({"compute": 0.6, "recompute": 0.2, "overhead": 0.05})
    explained = report.Comparison(1.2, "all cores", 1.6, cells, on_cpu=on_cpu).verdict()
    assert "faster here (1.20x the plain model)" in explained
    assert "(0.50x the plain model's 1600.00 ms" in explained
    assert ("using the cores" in explained) == on_cpu
    unexplained = report.Comparison(1.2, "all cores", 0.5, cells, on_cpu=on_cpu).verdict()
    assert "faster in this run (1.20x" in unexplained and "does not explain it" in unexplained


def test_format_breakdown_has_a_row_per_cell_with_the_shares() -> None:
    cells = report.breakdown(_made_up(), [_ALONE, _ALONE], threads=1)
    lines = report.format_breakdown(cells).splitlines()
    assert lines[0].split() == [
        "worker",
        "cells",
        "threads",
        "tasks",
        "compute/task",
        "overhead/task",
        "compute",
        "recompute",
        "overhead",
        "idle",
    ]
    assert len(lines) == 3
    shares = [float(word.rstrip("%")) for word in lines[1].split() if word.endswith("%")]
    assert sum(shares) == pytest.approx(100.0, abs=0.3)


def test_median_costs_takes_each_pass_median() -> None:
    runs = [StageCosts(5.0, 9.0, loss=1.0, forward_no_grad=1.0), StageCosts(4.0, 7.0)]
    runs.append(StageCosts(6.0, 8.0, loss=2.0, forward_no_grad=2.0))
    # forward_no_grad: the median of the runs that timed it.
    assert alone.median_costs(runs) == StageCosts(5.0, 8.0, loss=1.0, forward_no_grad=1.5)


def test_time_cell_alone_times_each_pass_and_runs_the_backward() -> None:
    cell = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    costs = alone.time_cell_alone(cell, torch.randn(4, 8), True, threads=1, repeats=2)
    assert all(
        t is not None and t > 0 and math.isfinite(t)
        for t in (costs.forward, costs.forward_no_grad, costs.backward)
    )
    assert cell[0].weight.grad is not None  # the backward ran


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_breakdown_of_a_real_step_is_consistent(make_pipe: Any, checkpoint: str) -> None:
    model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(32, 32), nn.Tanh())])
    pipe: gf.GPipe = make_pipe(model, [4, 4], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)
    x = torch.randn(16, 32)
    pipe(x).sum().backward()
    pipe.record_timeline()
    pipe(x).sum().backward()
    timeline = pipe.timeline()
    costs = alone.time_cells_alone(pipe, x, repeats=2)
    assert all(p.grad is None for p in pipe.parameters())
    cells = report.breakdown(timeline, costs, pipe.threads_per_cell)
    recomputes = 3 if checkpoint == "except_last" else 0
    for cell in cells:
        assert cell.tasks == 2 * 4 + recomputes
        assert (cell.recompute_s > 0) == (recomputes > 0)
        parts = [cell.compute_s, cell.recompute_s, cell.overhead_s, cell.idle_s]
        assert all(part >= 0 for part in parts)
        assert 0 < cell.share(cell.compute_s) <= 1
        assert sum(parts) == pytest.approx(cell.makespan_s, rel=1e-6, abs=1e-9)
    assert 0 <= report.simulated_bubble(timeline, costs) < 1


# -- a train_step of every schedule ------------------------------------------------------------

# The simulator's unit costs, a unit being 1 ms (as _step_of draws them).
_UNIT = StageCosts(forward=1e-3, backward=2e-3, backward_input=1e-3, backward_weight=1e-3,
                   forward_no_grad=1e-3)  # fmt: skip


def _step_of(schedule: str, workers: int, checkpoint: str, microbatches: int = 4) -> Timeline:
    """A made-up train_step timeline: `schedule`'s tasks simulated with unit costs."""
    cells = 2 * workers if schedule in ("interleaved", "zbv") else workers
    step = _C.make_schedule(schedule, cells, workers, microbatches, checkpoint)
    run = _C.simulate(step, _C.unit_costs(step))
    spans = [(task, int(run.start[task] * 1e6), int(run.end[task] * 1e6))
             for task in range(len(step.tasks))]  # fmt: skip
    return Timeline.from_runs([("step", step, spans)], schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_train_step_is_explained_per_worker(schedule: str) -> None:
    timeline = _step_of(schedule, workers=2, checkpoint="except_last")
    step = timeline.schedules()["step"]
    workers = report.breakdown(timeline, [_UNIT] * timeline.cells, threads=None)
    names = actions()
    for w, worker in enumerate(workers):
        tasks = [t for t in step.tasks if t.worker == w]
        assert worker.cells == tuple(sorted({t.stage for t in tasks}))
        assert worker.tasks == len(tasks)
        # The spans are the unit costs exactly, started as soon as they could: no overhead.
        assert worker.span_overhead_s == pytest.approx(0.0, abs=1e-12)
        assert worker.handoff_s == pytest.approx(0.0, abs=1e-9)
        recomputes = sum(names[t.action] == "recompute" for t in tasks)
        assert worker.recompute_s == pytest.approx(recomputes * 1e-3)
    idle = report.total_share(workers, lambda w: w.idle_s)
    assert idle == pytest.approx(timeline.bubble(), abs=1e-9)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_simulated_bubble_of_a_train_step_with_unit_costs_is_the_ideal(schedule: str) -> None:
    timeline = _step_of(schedule, workers=2, checkpoint="never")
    unit = report.simulated_bubble(timeline, [_UNIT] * timeline.cells)
    assert unit == pytest.approx(ideal_bubble(schedule, timeline.cells, 2, 4), abs=1e-12)


def test_a_timeline_of_no_one_process_step_is_refused() -> None:
    timeline = _relabelled(_step_of("zbv", workers=2, checkpoint="never"))
    with pytest.raises(ValueError, match="not those of a one-process 'zbv' step"):
        timeline.schedules()


def _relabelled(timeline: Timeline) -> Timeline:
    """The spans of `timeline` with one task's kind changed."""
    spans = list(timeline.spans)
    spans[0] = dataclasses.replace(spans[0], kind="loss")
    return Timeline(cells=timeline.cells, microbatches=timeline.microbatches, spans=spans,
                    workers=timeline.workers, schedule=timeline.schedule)  # fmt: skip


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_breakdown_of_a_real_train_step_is_consistent(make_pipe: Any, schedule: str) -> None:
    model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(32, 32), nn.Tanh())])
    balance = [2, 2, 2, 2] if schedule == "zbv" else [4, 4]
    pipe: gf.GPipe = make_pipe(model, balance, devices=["cpu"] * 2, chunks=4, schedule=schedule)
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    pipe.record_timeline()
    pipe.train_step(x, y, nn.functional.mse_loss)
    timeline = pipe.timeline()
    costs = alone.time_cells_alone(pipe, x, repeats=2, loss=(y, nn.functional.mse_loss))
    assert all(p.grad is None for p in pipe.parameters())
    assert costs[-1].loss > 0 and all(c.loss == 0 for c in costs[:-1])
    split = schedule == "zbv"
    assert all((c.backward_input > 0 and c.backward_weight > 0) == split for c in costs)
    workers = report.breakdown(timeline, costs, pipe.threads_per_cell)
    assert [w.cells for w in workers] == ([(0, 3), (1, 2)] if split else [(0,), (1,)])
    for worker in workers:
        parts = [worker.compute_s, worker.recompute_s, worker.overhead_s, worker.idle_s]
        assert all(part >= 0 for part in parts) and worker.compute_s > 0
        assert sum(parts) == pytest.approx(worker.makespan_s, rel=1e-6, abs=1e-9)
    assert 0 <= report.simulated_bubble(timeline, costs) < 1

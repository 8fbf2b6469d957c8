"""The demo's explanation of a pipelined step: compute, overhead, idle per cell; the verdict."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.nn.microbatch import scatter
from gpipe_fast.runtime.timeline import Kind
from gpipe_fast.schedule.registry import actions
from gpipe_fast.skip import CellSkipTracker, SkipLayout, inspect_skip_layout, use_skip_tracker


@dataclass(frozen=True)
class AloneCosts:
    """Seconds one cell takes on one micro-batch, timed alone outside the pipe (median)."""

    forward: float  # without a graph: the forward of a checkpointed micro-batch
    forward_grad: float  # building the graph: a forward not checkpointed, or a recompute
    backward: float

    def of(self, kind: Kind, checkpointed: bool) -> float:
        """What a task of this kind computes, on a micro-batch checkpointed or not."""
        if kind == "backward":
            return self.backward
        if kind == "forward" and checkpointed:
            return self.forward
        return self.forward_grad


@dataclass(frozen=True)
class CellBreakdown:
    """Where one cell's time went in one step (phases concatenated, as Timeline.makespan).

    ``compute_s + recompute_s + overhead_s + idle_s == makespan_s``: compute is the cell's
    tasks timed alone (recompute: its re-run forwards), overhead what the pipe added (task
    spans beyond that compute, and hand-offs: a task starting later than its inputs and its
    cell were ready), idle the rest (waiting for the other cells: fill, drain, imbalance)."""

    cell: int
    threads: int | None
    tasks: int
    makespan_s: float
    compute_s: float
    recompute_s: float
    span_overhead_s: float
    handoff_s: float

    @property
    def overhead_s(self) -> float:
        return self.span_overhead_s + self.handoff_s

    @property
    def idle_s(self) -> float:
        return max(0.0, self.makespan_s - self.compute_s - self.recompute_s - self.overhead_s)

    def share(self, seconds: float) -> float:
        return seconds / self.makespan_s if self.makespan_s > 0 else 0.0


# -- measuring --------------------------------------------------------------------------------


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """This thread's intra-op threads set to `threads` (None: left as they are)."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _timer(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock
    return time.perf_counter


def time_cell_alone(
    cell: nn.Module,
    sample: Tensor,
    needs_input_grad: bool,
    threads: int | None,
    repeats: int = 5,
) -> AloneCosts:
    """Times `cell` on `sample` (one micro-batch, on the cell's device) on this thread with
    `threads` intra-op threads, as the cell's worker runs it: the medians of `repeats` runs
    after one warm-up. The backward accumulates into the cell's .grad; zero it afterwards."""
    clock = _timer(sample.device)
    forward, forward_grad, backward = [], [], []
    with intra_op_threads(threads):
        for _ in range(repeats + 1):
            start = clock()
            with torch.no_grad():
                cell(sample)
            forward.append(clock() - start)
            leaf = sample.detach().requires_grad_(needs_input_grad)
            start = clock()
            with torch.enable_grad():
                output = cell(leaf)
            built = clock()
            grad = torch.ones_like(output)
            begin = clock()
            torch.autograd.backward(output, grad)
            backward.append(clock() - begin)
            forward_grad.append(built - start)
    return AloneCosts(
        statistics.median(forward[1:]),
        statistics.median(forward_grad[1:]),
        statistics.median(backward[1:]),
    )


def median_costs(runs: Sequence[AloneCosts]) -> AloneCosts:
    """Each pass's median over several timings of one cell."""
    return AloneCosts(
        statistics.median(r.forward for r in runs),
        statistics.median(r.forward_grad for r in runs),
        statistics.median(r.backward for r in runs),
    )


class _WithSkips(nn.Module):
    """A cell run alone with the skips that earlier cells stashed for it (a fresh tracker per
    call, so every run pops them again); what it stashes for later cells is dropped."""

    def __init__(self, cell: nn.Module, layout: SkipLayout, k: int, received: dict[Any, Any]):
        super().__init__()
        self.cell, self.layout, self.k, self.received = cell, layout, k, received

    def forward(self, x: Tensor) -> Tensor:
        with use_skip_tracker(CellSkipTracker(self.layout, self.k, self.received)):
            return self.cell(x)  # type: ignore[no-any-return]


def time_cells_alone(pipe: gf.GPipe, batch: Tensor, repeats: int = 5) -> list[AloneCosts]:
    """Each cell of `pipe` timed alone on the first micro-batch of `batch` (its input, and the
    skips it pops, made by the cells before it), with the pipe's threads per cell. Leaves
    the cells' .grad zeroed."""
    sample = scatter(batch, pipe.chunks)[0]
    assert isinstance(sample, Tensor)
    layout = inspect_skip_layout([cast(nn.Sequential, cell) for cell in pipe.partitions])
    stashed: dict[Any, Any] = {}  # the skips cells stashed for later ones, by key
    costs = []
    for k, cell in enumerate(pipe.partitions):
        sample = sample.to(pipe.devices[k])
        received = {key: stashed[key] for key in layout.receives(k)}
        timed = _WithSkips(cell, layout, k, received)
        # A cell's input needs a gradient when a cell before it learns (as in the pipe).
        costs.append(time_cell_alone(timed, sample, k > 0, pipe.threads_per_cell, repeats))
        tracker = CellSkipTracker(layout, k, received)
        with torch.no_grad(), use_skip_tracker(tracker):
            sample = cell(sample)
        stashed.update(tracker.outgoing)
    pipe.zero_grad(set_to_none=True)
    return costs


# -- explaining -------------------------------------------------------------------------------


def _schedules(timeline: gf.Timeline, checkpointed: Sequence[bool]) -> dict[str, _C.Schedule]:
    """The schedules the pipe ran (the spans' task ids index them)."""
    cells, count = timeline.cells, timeline.microbatches
    return {
        "forward": _C.gpipe_forward(cells, count),
        "backward": _C.gpipe_backward(cells, count, list(checkpointed)),
    }


def checkpointed_microbatches(timeline: gf.Timeline) -> list[bool]:
    """Which micro-batches the step checkpointed: those with a recompute task."""
    recomputed = {s.microbatch for s in timeline.spans if s.kind == "recompute"}
    return [m in recomputed for m in range(timeline.microbatches)]


def handoff_seconds(timeline: gf.Timeline) -> list[float]:
    """Per cell, the time its tasks started after they could have: after the previous task on
    the cell and the tasks they take inputs from had ended (the executor's hand-offs)."""
    schedules = _schedules(timeline, checkpointed_microbatches(timeline))
    gaps = [0.0] * timeline.cells
    for phase, schedule in schedules.items():
        spans = {s.task: s for s in timeline.spans if s.phase == phase and s.kind != "copy"}
        if not spans:
            continue
        phase_start = min(s.start_s for s in spans.values())
        for cell in range(timeline.cells):
            previous_end = phase_start
            for task in schedule.order(cell):
                span = spans[task]
                ready = max(
                    [previous_end] + [spans[dep].end_s for dep in schedule.tasks[task].deps]
                )
                gaps[cell] += max(0.0, span.start_s - ready)
                previous_end = span.end_s
    return gaps


def breakdown(
    timeline: gf.Timeline, alone: Sequence[AloneCosts], threads: int | None
) -> list[CellBreakdown]:
    """Per cell: the step's makespan split into compute, recompute, overhead and idle."""
    checkpointed = checkpointed_microbatches(timeline)
    handoffs = handoff_seconds(timeline)
    cells = []
    for k in range(timeline.cells):
        spans = [s for s in timeline.spans if s.cell == k and s.kind != "copy"]
        busy = sum(s.duration_s for s in spans)
        compute = sum(
            alone[k].of(s.kind, checkpointed[s.microbatch]) for s in spans if s.kind != "recompute"
        )
        recompute = sum(alone[k].of(s.kind, True) for s in spans if s.kind == "recompute")
        # Noise can make the alone timing exceed the spans: then the overhead is nil and the
        # compute is what the spans took, so the parts still add up to the makespan.
        scale = min(1.0, busy / (compute + recompute)) if compute + recompute > 0 else 0.0
        cells.append(
            CellBreakdown(
                cell=k,
                threads=threads,
                tasks=len(spans),
                makespan_s=timeline.makespan,
                compute_s=compute * scale,
                recompute_s=recompute * scale,
                span_overhead_s=max(0.0, busy - compute - recompute),
                handoff_s=handoffs[k],
            )
        )
    return cells


def simulated_bubble(timeline: gf.Timeline, alone: Sequence[AloneCosts]) -> float:
    """The bubble of the step's schedules with the cells' alone costs and no overhead: the
    fill-drain bubble plus what the cells' imbalance adds."""
    checkpointed = checkpointed_microbatches(timeline)
    makespan = busy = 0.0
    names = actions()
    for schedule in _schedules(timeline, checkpointed).values():
        costs = []
        for task in schedule.tasks:
            kind = names[task.action]
            costs.append(alone[task.stage].of(kind, checkpointed[task.microbatch]))
        makespan += _C.simulate(schedule, costs).makespan
        busy += sum(costs)
    return 1.0 - busy / (timeline.cells * makespan) if makespan > 0 else 0.0


# -- printing ---------------------------------------------------------------------------------


_COLUMNS = (
    *("cell", "threads", "tasks", "compute/task", "overhead/task"),
    *("compute", "recompute", "overhead", "idle"),
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def format_breakdown(cells: Sequence[CellBreakdown]) -> str:
    """A table: per cell, its threads and tasks, compute and overhead per task, and the
    shares of the step's makespan that went to compute, recompute, overhead and idle."""
    rows: list[tuple[str, ...]] = [_COLUMNS]
    for c in cells:
        tasks = max(1, c.tasks)
        rows.append(
            (
                str(c.cell),
                "default" if c.threads is None else str(c.threads),
                str(c.tasks),
                _ms((c.compute_s + c.recompute_s) / tasks),
                _ms(c.overhead_s / tasks),
                *(
                    f"{c.share(x):.1%}"
                    for x in (c.compute_s, c.recompute_s, c.overhead_s, c.idle_s)
                ),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join(
        "  ".join(text.rjust(width) for text, width in zip(row, widths, strict=True))
        for row in rows
    )


def total_share(cells: Sequence[CellBreakdown], part: Callable[[CellBreakdown], float]) -> float:
    """`part`'s share of all cells' time over the step."""
    time_ = sum(c.makespan_s for c in cells)
    return sum(part(c) for c in cells) / time_ if time_ > 0 else 0.0


@dataclass(frozen=True)
class Comparison:
    """gpipe_fast against the plain model, with what the step's breakdown says about why."""

    ratio: float  # gpipe_fast's throughput over the plain model's
    rival: str  # where the plain model ran, in words
    plain_work_s: float  # the plain model's forward and backward of one step, timed alone
    cells: Sequence[CellBreakdown]
    on_cpu: bool  # the cells share one CPU's cores

    def work_line(self) -> str:
        compute = sum(c.compute_s for c in self.cells)
        recompute = sum(c.recompute_s for c in self.cells)
        per_cell = (compute + recompute) / max(1, len(self.cells))
        return (
            f"work of one step, timed alone: the plain model {_ms(self.plain_work_s)} "
            f"({self.rival}); the cells {_ms(compute)} + {_ms(recompute)} recompute, "
            f"{_ms(per_cell)} per cell"
        )

    def _work_clause(self) -> str:
        cells = self.cells
        per_cell = sum(c.compute_s + c.recompute_s for c in cells) / max(1, len(cells))
        recompute = total_share(cells, lambda c: c.recompute_s)
        times = per_cell / self.plain_work_s if self.plain_work_s > 0 else math.inf
        return (
            f"each cell's share of the work, timed alone, takes {_ms(per_cell)} ({times:.2f}x "
            f"the plain model's {_ms(self.plain_work_s)}; the recompute of checkpointed "
            f"micro-batches included, {recompute:.1%} of cell time)"
        )

    def _pipe_clause(self) -> str:
        idle = total_share(self.cells, lambda c: c.idle_s)
        overhead = total_share(self.cells, lambda c: c.overhead_s)
        return (
            f"the time cells wait for each other (fill, drain, imbalance: {idle:.1%} of cell "
            f"time) and overhead ({overhead:.1%})"
        )

    def verdict(self) -> str:
        """Faster or slower, plainly, and why, from the figures printed before it."""
        head = f"verdict: gpipe_fast is {{}} here ({self.ratio:.2f}x the plain model)"
        work, pipe = self._work_clause(), self._pipe_clause()
        fit = "pipelining pays off when a model does not fit one device"
        if self.ratio < 1.0:
            if self.on_cpu:
                count = len(self.cells)
                sharing = "Its one cell uses" if count == 1 else f"Its {count} cells share"
                return (
                    f"{head.format('slower')}. {sharing} the cores that the plain model uses "
                    f"alone, so on one CPU a pipeline can at best match "
                    f"it: {work}, and the pipe adds {pipe}. {fit.capitalize()}, not as a "
                    f"speed-up on one CPU."
                )
            return f"{head.format('slower')}: {work}, and the pipe adds {pipe}. {fit.capitalize()}."
        per_cell = sum(c.compute_s + c.recompute_s for c in self.cells) / max(1, len(self.cells))
        if per_cell >= self.plain_work_s:
            return (
                f"verdict: gpipe_fast was faster in this run ({self.ratio:.2f}x the plain "
                f"model), but the work timed alone does not explain it: {work}. The plain model "
                f"ran slower in training than alone, likely from other work on this machine; "
                f"rerun with more --steps."
            )
        if not self.on_cpu:
            return (
                f"{head.format('faster')}: {work}, the cells running at once on their devices; "
                f"that outweighs {pipe}."
            )
        return (
            f"{head.format('faster')}: {work}. A cell runs whole ops on threads of its own, "
            f"where the plain model splits every op over all cores and waits for them each time "
            f"(the more so when other work takes the cores); that outweighs {pipe}. The gain is "
            f"in using the cores, not in pipelining: {fit}."
        )


def write_timeline(timeline: gf.Timeline, out: Path, trace_note: str) -> None:
    """Writes the timeline's Chrome trace and, when matplotlib is installed, its picture to
    `out`, printing where (`trace_note` follows the trace's path)."""
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "timeline.trace.json"
    timeline.to_chrome_trace(trace)
    print(f"timeline trace: {trace} ({trace_note})")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("timeline picture: skipped, needs matplotlib (pip install matplotlib)")
        return
    picture = out / "timeline.png"
    timeline.plot(picture)
    print(f"timeline picture: {picture}")

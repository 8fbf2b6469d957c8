"""The demo's explanation of a pipelined step: compute, overhead, idle per worker; the verdict."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.planning.predict import StageCosts
from gpipe_fast.planning.predict import task_costs as priced
from gpipe_fast.runtime.timeline import Phase


@dataclass(frozen=True)
class WorkerBreakdown:
    """Where one worker's time went in one step (phases concatenated, as Timeline.makespan).

    ``compute_s + recompute_s + overhead_s + idle_s == makespan_s``: compute is the tasks of
    the worker's cells timed alone (recompute: their re-run forwards), overhead what the
    pipe added (task spans beyond that compute, and hand-offs: a task starting later than
    its inputs and its worker were ready), idle the rest (waiting for the other workers:
    fill, drain, imbalance)."""

    worker: int
    cells: tuple[int, ...]  # the cells it runs: one, or several (interleaved, zbv)
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


# -- explaining -------------------------------------------------------------------------------


def task_costs(timeline: gf.Timeline, costs: Sequence[StageCosts]) -> dict[Phase, list[float]]:
    """Each task's cost, by phase, with the cells' `costs` timed alone: as the planner prices
    a schedule's tasks, a checkpointed micro-batch's forward at its cost without a graph."""
    again = timeline.checkpointed()
    return {
        phase: priced(schedule, costs, 0.0, again)
        for phase, schedule in timeline.schedules().items()
    }


def breakdown(
    timeline: gf.Timeline, alone: Sequence[StageCosts], threads: int | None
) -> list[WorkerBreakdown]:
    """Per worker: the step's makespan split into compute, recompute, overhead and idle."""
    prices = task_costs(timeline, alone)
    handoffs = timeline.handoffs()
    workers = []
    for w in range(timeline.rows):
        spans = [s for s in timeline.spans if s.row == w and s.kind != "copy"]
        busy = timeline.busy(w)
        compute = sum(prices[s.phase][s.task] for s in spans if s.kind != "recompute")
        recompute = sum(prices[s.phase][s.task] for s in spans if s.kind == "recompute")
        # Noise can make the alone timing exceed the spans: then the overhead is nil and the
        # compute is what the spans took, so the parts still add up to the makespan.
        scale = min(1.0, busy / (compute + recompute)) if compute + recompute > 0 else 0.0
        workers.append(
            WorkerBreakdown(
                worker=w,
                cells=tuple(sorted({s.cell for s in spans})),
                threads=threads,
                tasks=len(spans),
                makespan_s=timeline.makespan,
                compute_s=compute * scale,
                recompute_s=recompute * scale,
                span_overhead_s=max(0.0, busy - compute - recompute),
                handoff_s=handoffs[w],
            )
        )
    return workers


def simulated_bubble(timeline: gf.Timeline, alone: Sequence[StageCosts]) -> float:
    """The bubble of the step's schedules with the cells' alone costs and no overhead: the
    schedule's own bubble plus what the cells' imbalance adds."""
    prices = task_costs(timeline, alone)
    makespan = busy = 0.0
    for phase, schedule in timeline.schedules().items():
        makespan += _C.simulate(schedule, prices[phase]).makespan
        busy += sum(prices[phase])
    workers = max(timeline.stage_workers()) + 1
    return 1.0 - busy / (workers * makespan) if makespan > 0 else 0.0


# -- printing ---------------------------------------------------------------------------------


_COLUMNS = (
    *("worker", "cells", "threads", "tasks", "compute/task", "overhead/task"),
    *("compute", "recompute", "overhead", "idle"),
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def format_breakdown(workers: Sequence[WorkerBreakdown]) -> str:
    """A table: per worker, its cells, threads and tasks, compute and overhead per task, and
    the shares of the step's makespan that went to compute, recompute, overhead and idle."""
    rows: list[tuple[str, ...]] = [_COLUMNS]
    for c in workers:
        tasks = max(1, c.tasks)
        rows.append(
            (
                str(c.worker),
                ",".join(map(str, c.cells)),
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


def total_share(
    workers: Sequence[WorkerBreakdown], part: Callable[[WorkerBreakdown], float]
) -> float:
    """`part`'s share of all workers' time over the step."""
    time_ = sum(c.makespan_s for c in workers)
    return sum(part(c) for c in workers) / time_ if time_ > 0 else 0.0


@dataclass(frozen=True)
class Comparison:
    """gpipe_fast against the plain model, with what the step's breakdown says about why."""

    ratio: float  # gpipe_fast's throughput over the plain model's
    rival: str  # where the plain model ran, in words
    plain_work_s: float  # the plain model's forward, loss and backward of one step, alone
    workers: Sequence[WorkerBreakdown]
    on_cpu: bool  # the workers share one CPU's cores

    @property
    def _noun(self) -> str:
        """What shares the work: "cell", or "worker" when a worker runs several cells."""
        return "cell" if all(len(w.cells) <= 1 for w in self.workers) else "worker"

    def _per_worker(self) -> float:
        work = sum(w.compute_s + w.recompute_s for w in self.workers)
        return work / max(1, len(self.workers))

    def work_line(self) -> str:
        compute = sum(w.compute_s for w in self.workers)
        recompute = sum(w.recompute_s for w in self.workers)
        return (
            f"work of one step, timed alone: the plain model {_ms(self.plain_work_s)} "
            f"({self.rival}); the cells {_ms(compute)} + {_ms(recompute)} recompute, "
            f"{_ms(self._per_worker())} per {self._noun}"
        )

    def _work_clause(self) -> str:
        per_worker = self._per_worker()
        recompute = total_share(self.workers, lambda w: w.recompute_s)
        times = per_worker / self.plain_work_s if self.plain_work_s > 0 else math.inf
        noun = self._noun
        return (
            f"each {noun}'s share of the work, timed alone, takes {_ms(per_worker)} "
            f"({times:.2f}x the plain model's {_ms(self.plain_work_s)}; the recompute of "
            f"checkpointed micro-batches included, {recompute:.1%} of {noun} time)"
        )

    def _pipe_clause(self) -> str:
        idle = total_share(self.workers, lambda w: w.idle_s)
        overhead = total_share(self.workers, lambda w: w.overhead_s)
        noun = self._noun
        return (
            f"the time {noun}s wait for each other (fill, drain, imbalance: {idle:.1%} of "
            f"{noun} time) and overhead ({overhead:.1%})"
        )

    def verdict(self) -> str:
        """Faster or slower, plainly, and why, from the figures printed before it."""
        head = f"verdict: gpipe_fast is {{}} here ({self.ratio:.2f}x the plain model)"
        work, pipe = self._work_clause(), self._pipe_clause()
        fit = "pipelining pays off when a model does not fit one device"
        if self.ratio < 1.0:
            if self.on_cpu:
                count = len(self.workers)
                sharing = (
                    f"Its one {self._noun} uses"
                    if count == 1
                    else f"Its {count} {self._noun}s share"
                )
                return (
                    f"{head.format('slower')}. {sharing} the cores that the plain model uses "
                    f"alone, so on one CPU a pipeline can at best match "
                    f"it: {work}, and the pipe adds {pipe}. {fit.capitalize()}, not as a "
                    f"speed-up on one CPU."
                )
            return f"{head.format('slower')}: {work}, and the pipe adds {pipe}. {fit.capitalize()}."
        if self._per_worker() >= self.plain_work_s:
            return (
                f"verdict: gpipe_fast was faster in this run ({self.ratio:.2f}x the plain "
                f"model), but the work timed alone does not explain it: {work}. The plain model "
                f"ran slower in training than alone, likely from other work on this machine; "
                f"rerun with more --steps."
            )
        if not self.on_cpu:
            return (
                f"{head.format('faster')}: {work}, the {self._noun}s running at once on their "
                f"devices; that outweighs {pipe}."
            )
        return (
            f"{head.format('faster')}: {work}. A {self._noun} runs whole ops on threads of its "
            f"own, where the plain model splits every op over all cores and waits for them each "
            f"time (the more so when other work takes the cores); that outweighs {pipe}. The "
            f"gain is in using the cores, not in pipelining: {fit}."
        )


_BROWSER = "open it in a web browser: a box's task shows on hover"


def say(text: str) -> None:
    """Prints a paragraph wrapped to 100 columns, its later lines indented (as the demo)."""
    print(textwrap.fill(text, 100, subsequent_indent="  ", break_long_words=False,
                        break_on_hyphens=False))  # fmt: skip


def write_timeline(timeline: gf.Timeline, out: Path, trace_note: str) -> list[Path]:
    """Writes the timeline's Chrome trace and its picture to `out`: an SVG always (nothing to
    install), and a PNG too when matplotlib is installed. Prints where (`trace_note` follows
    the trace's path) and returns the pictures' paths."""
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "timeline.trace.json"
    timeline.to_chrome_trace(trace)
    print(f"timeline trace: {trace} ({trace_note})")
    pictures = [out / "timeline.svg"]
    timeline.to_svg(pictures[0])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        say(f"timeline picture: {pictures[0]} ({_BROWSER}; with matplotlib, a PNG too)")
        return pictures
    pictures.append(out / "timeline.png")
    timeline.plot(pictures[1])
    say(f"timeline picture: {pictures[1]}, and {pictures[0]} ({_BROWSER})")
    return pictures

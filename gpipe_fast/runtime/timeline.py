"""The measured task timeline of one step: spans per worker, bubble, Chrome trace and picture."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpipe_fast import _C
from gpipe_fast.pictures import content, png, svg, trace
from gpipe_fast.schedule.registry import (
    actions,
    communication_actions,
    ideal_bubble,
    one_way_actions,
    recomputed,
    schedule_kind,
)

# The runs of a step: pipe(x)'s forward, loss.backward()'s backward, or a train_step.
Phase = Literal["forward", "backward", "step"]
_PHASES: tuple[Phase, ...] = ("forward", "backward", "step")
# A span's kind is its task's action ("forward", "recompute", "backward", "backward_input",
# "backward_weight", "loss", ...) or "copy" (reserved for boundary copies timed apart).
Kind = str
# What timed a worker's tasks: the steady clock on its thread, or CUDA events on its stream.
Clock = Literal["host", "cuda"]
_CLOCKS: tuple[Clock, ...] = ("host", "cuda")

_NS = 1e-9


@dataclass(frozen=True)
class TaskSpan:
    """One task as it ran: when it started and ended, in seconds after the step's start.

    What the span measures depends on the cell's clock (:attr:`Timeline.clocks`):

    - CPU cells ("host"): host time, the steady clock read on the cell's worker thread
      just before the task's Python call (its wait for the GIL included) and just after it
      returns.
    - CUDA cells ("cuda"): GPU execution time, from CUDA timing events recorded on the
      cell's stream just before and just after the task's Python call: from when the stream
      reached the task (its producers' work done) to when it finished the work the task
      enqueued, however early the call itself returned. Event times are carried onto the
      host's steady clock through a per-device anchor (tied when recording starts, renewed
      when older than a second), so CPU and CUDA cells share one time axis: an anchor is
      off by at most half the host-clock bracket of its calibration (microseconds unless
      the host thread was preempted), and one run's spans on one device keep their exact
      order.

    ``task`` is the task's id in its phase's schedule (``_C.gpipe_forward`` for "forward",
    ``_C.gpipe_backward`` for "backward", the train_step's schedule for "step"). ``cell`` is
    the task's stage, ``worker`` the worker thread that ran it (the same but for the
    interleaved and zbv schedules, whose workers run several stages). The "copy" kind is
    reserved for boundary copies timed on their own; gpipe_fast records none at present (a
    copy is part of its task).
    """

    phase: Phase
    kind: Kind
    cell: int
    microbatch: int
    start_s: float
    end_s: float
    task: int = -1
    worker: int = -1

    @property
    def stage(self) -> int:
        return self.cell

    @property
    def row(self) -> int:
        """The worker that ran the span (its cell when not recorded)."""
        return self.worker if self.worker >= 0 else self.cell

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Timeline:
    """The spans of one step's tasks: the forward run by ``pipe(x)`` and, once
    ``loss.backward()`` has run, the backward; or the one run of a ``train_step``.

    Times are seconds of the steady clock (``time.monotonic``) after the start of the
    step's first task, so the backward's spans also contain the gap during which the
    caller's thread computed the loss and reached the pipe's backward; that gap belongs to
    no worker and is left out of :attr:`makespan` and :meth:`bubble`.

    ``cells`` counts the stages, ``workers`` the worker threads that ran them (as many, but
    for the interleaved and zbv schedules). ``clocks`` names, per worker, what timed its spans (see
    :class:`TaskSpan`): "host" on CPU, "cuda" (CUDA events on its stream) on CUDA devices;
    empty when unknown. ``schedule`` is the kind of the train_step's schedule ("gpipe" for
    pipe(x) and its backward). ``call_s`` is how long the ``train_step`` call took, from
    entry to return (its tasks and the work around them: splitting the batch, the loss);
    0 for ``pipe(x)`` and its backward. ``whole_backward`` names the cells (of this process)
    whose split backward (zero_bubble, zbv) computes the weight gradients of their compiled
    layers in ``backward_input``: a compiled layer's backward is one compiled function,
    which computes the input and weight gradients together, so ``backward_weight`` computes
    only the other layers' (nothing, when all are compiled).
    """

    cells: int
    microbatches: int
    spans: list[TaskSpan] = field(default_factory=list)
    clocks: tuple[Clock, ...] = ()
    workers: int = 0
    schedule: str = "gpipe"
    # Names of the picture's rows, when the workers are not named by their cells (the ranks'
    # compute and communication workers of a multi-process step).
    row_names: tuple[str, ...] = ()
    call_s: float = 0.0
    whole_backward: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        """Worker rows of the picture: `workers`, or one per cell when not known."""
        return self.workers or self.cells

    @classmethod
    def from_runs(
        cls,
        runs: Sequence[tuple[Phase, Any, Iterable[tuple[int, int, int]]]],
        clocks: Sequence[str] = (),
        schedule: str = "gpipe",
        call_s: float = 0.0,
        whole_backward: Sequence[int] = (),
    ) -> Timeline:
        """Builds the timeline from executor runs: (phase, schedule, ``last_spans()``), and
        optionally the executor's ``worker_clocks()``, the train_step's schedule kind, its
        call's duration and the cells whose split backward runs compiled layers whole."""
        if not runs:
            raise ValueError("a timeline needs at least one run")
        first = runs[0][1]
        worker_clocks = tuple(_clock(name) for name in clocks)
        if worker_clocks and len(worker_clocks) != first.workers:
            raise ValueError(f"got {len(worker_clocks)} clocks for {first.workers} workers")
        names = actions()
        raw = [(phase, schedule, *span) for phase, schedule, spans in runs for span in spans]
        origin = min((start_ns for *_, start_ns, _end in raw), default=0)
        spans_out = []
        for phase, run, task_id, start_ns, end_ns in raw:
            task = run.tasks[task_id]
            spans_out.append(
                TaskSpan(
                    phase=phase,
                    kind=names[task.action],
                    cell=task.stage,
                    microbatch=task.microbatch,
                    start_s=(start_ns - origin) * _NS,
                    end_s=(end_ns - origin) * _NS,
                    task=task_id,
                    worker=task.worker,
                )
            )
        spans_out.sort(key=lambda s: (s.start_s, s.row))
        return cls(
            cells=first.stages,
            microbatches=first.microbatches,
            spans=spans_out,
            clocks=worker_clocks,
            workers=first.workers,
            schedule=schedule,
            call_s=call_s,
            whole_backward=tuple(whole_backward),
        )

    # -- measures ----------------------------------------------------------------------------

    def phase_window(self, phase: Phase) -> tuple[float, float]:
        """First start and last end of the phase's spans; (0, 0) if the phase did not run."""
        spans = [s for s in self.spans if s.phase == phase]
        if not spans:
            return 0.0, 0.0
        return min(s.start_s for s in spans), max(s.end_s for s in spans)

    @property
    def gap_s(self) -> float:
        """Time between the forward's last task end and the backward's first task start."""
        if not any(s.phase == "backward" for s in self.spans):
            return 0.0
        return self.phase_window("backward")[0] - self.phase_window("forward")[1]

    @property
    def makespan(self) -> float:
        """Seconds the workers spent in the step: each phase's window (first task start to
        last task end) added up, without the gap between pipe(x) and its backward."""
        return sum((end - start for start, end in map(self.phase_window, _PHASES)), 0.0)

    def busy(self, worker: int) -> float:
        """Seconds `worker` (with one stage per worker: that cell) spent in tasks (copy
        spans lie inside tasks and are not added)."""
        if not 0 <= worker < self.rows:
            raise ValueError(f"worker must be in [0, {self.rows}), got {worker}")
        return sum(s.duration_s for s in self.spans if s.row == worker and s.kind != "copy")

    def working(self, worker: int) -> float:
        """Seconds `worker` spent in tasks other than receives: a receive mostly waits for
        its data (on a compute worker that takes its messages itself, that wait is idle)."""
        waits = one_way_actions("receive")
        receives = sum(s.duration_s for s in self.spans if s.row == worker and s.kind in waits)
        return self.busy(worker) - receives

    def compute_rows(self) -> list[int]:
        """The workers that compute (not those that only communicate)."""
        communication = communication_actions()
        rows = sorted({s.row for s in self.spans if s.kind not in communication})
        return rows or list(range(self.rows))

    def bubble(self) -> float:
        """Measured idle share of the computing workers' time:
        ``1 - sum_w busy(w) / (workers * makespan)`` over them.

        The phases are concatenated: each phase counts from its first task's start to its
        last task's end, and the gap between ``pipe(x)`` returning and the backward's first
        task (the loss, on the caller's thread) is not counted. Per-task overheads outside
        the tasks' spans (the executor's hand-offs) count as idle, and so do the receives
        that a compute worker runs itself (see :meth:`working`).
        """
        makespan = self.makespan
        if makespan <= 0:
            return 0.0
        rows = self.compute_rows()
        busy = sum(self.working(worker) for worker in rows)
        return max(0.0, 1.0 - busy / (len(rows) * makespan))

    @property
    def ideal_bubble(self) -> float:
        """The bubble of the step's schedule with equal-cost stages and no overheads (a
        forward 1, a backward 2, each half of it 1): the schedule kind's step simulated
        natively (gf._C.ideal_bubble); for pipe(x) and its backward on workers that run
        several cells, their fill-drain runs on those workers."""
        workers, microbatches = len(self.compute_rows()), self.microbatches
        stages_per_worker = schedule_kind(self.schedule).stages_per_worker
        if stages_per_worker == 0 or self.cells == stages_per_worker * workers:
            return ideal_bubble(self.schedule, self.cells, workers, microbatches)
        stage_workers = self.stage_workers()
        runs = [
            _C.gpipe_forward(self.cells, microbatches, stage_workers),
            _C.gpipe_backward(self.cells, microbatches, [False] * microbatches, stage_workers),
        ]
        costs = [_C.unit_costs(run) for run in runs]
        makespan = sum(_C.simulate(r, c).makespan for r, c in zip(runs, costs, strict=True))
        return 1.0 - sum(map(sum, costs)) / (workers * makespan)

    # -- the schedules that ran ---------------------------------------------------------------

    def stage_workers(self) -> list[int]:
        """The worker of each cell, as the spans show it (the cell's own number where none
        ran)."""
        placement = {s.cell: s.row for s in self.spans}
        return [placement.get(cell, cell) for cell in range(self.cells)]

    def checkpointed(self) -> set[tuple[int, int]]:
        """The (cell, micro-batch) pairs the step checkpointed: those with a recompute task."""
        return {(s.cell, s.microbatch) for s in self.spans if s.kind == "recompute"}

    def schedules(self) -> dict[Phase, Any]:
        """The schedules the step ran, by phase (its spans' task ids index them): a
        train_step's, or pipe(x)'s fill-drain forward and its backward. ValueError when the
        spans are no one-process train_step's tasks."""
        if any(s.phase == "step" for s in self.spans):
            return {"step": self._train_step_schedule()}
        again = {m for _, m in self.checkpointed()}
        flags = [m in again for m in range(self.microbatches)]
        cells, count, workers = self.cells, self.microbatches, self.stage_workers()
        return {
            "forward": _C.gpipe_forward(cells, count, workers),
            "backward": _C.gpipe_backward(cells, count, flags, workers),
        }

    def _train_step_schedule(self) -> Any:
        """The train_step schedule of one process that the step ran: the checkpoint mode is
        the one whose recomputes the spans show and whose tasks are the spans'."""
        workers = max(self.stage_workers()) + 1
        names = actions()
        spans = [s for s in self.spans if s.phase == "step"]
        for mode in ("never", "except_last", "always"):
            schedule = _C.make_schedule(self.schedule, self.cells, workers, self.microbatches,
                                        mode)  # fmt: skip
            flags = recomputed(schedule)
            again = {(k, m) for k, row in enumerate(flags) for m, flag in enumerate(row) if flag}
            tasks = schedule.tasks
            if again == self.checkpointed() and all(
                s.task < len(tasks) and (names[tasks[s.task].action], tasks[s.task].stage,
                                         tasks[s.task].microbatch) == (s.kind, s.cell, s.microbatch)
                for s in spans
            ):  # fmt: skip
                return schedule
        raise ValueError(
            f"the timeline's tasks are not those of a one-process {self.schedule!r} step of "
            f"{self.cells} cells and {self.microbatches} micro-batches"
        )

    def handoffs(self) -> list[float]:
        """Per worker, the seconds its tasks started after they could have: after the previous
        task on the worker and the tasks they take inputs from had ended (the executor's
        hand-offs, counted as idle by :meth:`bubble`)."""
        gaps = [0.0] * self.rows
        for phase, schedule in self.schedules().items():
            spans = {s.task: s for s in self.spans if s.phase == phase and s.kind != "copy"}
            if not spans:
                continue
            phase_start = min(s.start_s for s in spans.values())
            for worker in range(schedule.workers):
                previous_end = phase_start
                for task in schedule.order(worker):
                    span = spans[task]
                    inputs = [spans[dep].end_s for dep in schedule.tasks[task].deps]
                    gaps[worker] += max(0.0, span.start_s - max([previous_end, *inputs]))
                    previous_end = span.end_s
        return gaps

    # -- outputs -----------------------------------------------------------------------------

    def label(self, span: TaskSpan) -> str:
        """The span's name in pictures and traces: action letter, stage.micro-batch."""
        return content.label(span)

    def row_name(self, worker: int) -> str:
        if self.row_names:
            return self.row_names[worker]
        stages = sorted({s.cell for s in self.spans if s.row == worker}) or [worker]
        if self.rows == self.cells:
            return f"cell {stages[0]}"
        return f"worker {worker} (cells {', '.join(map(str, stages))})"

    def to_chrome_trace(self, path: str | Path) -> None:
        """Writes Chrome trace JSON (chrome://tracing, ui.perfetto.dev): one track per worker,
        one complete ("X") event per span, times in microseconds."""
        trace.to_chrome_trace(self, path)

    def plot(self, path: str | Path) -> None:
        """Draws the timeline as a PNG: one row per worker, each task a box coloured by its
        action and labelled, where it fits, with its stage and micro-batch ("F2.5": forward
        of cell 2 on micro-batch 5); a receive, mostly a wait for its data, hatched as idle;
        the legend grouped as compute, communication and idle. Needs matplotlib
        (``gpipe_fast[plot]``); :meth:`to_svg` draws the same with nothing to install."""
        png.plot(self, path)

    def to_svg(self, path: str | Path) -> None:
        """Writes the picture of :meth:`plot` as SVG, without matplotlib; a web browser shows
        each box's task in words (action, cell, micro-batch, times, worker) on hover."""
        svg.to_svg(self, path)


def _clock(name: str) -> Clock:
    for clock in _CLOCKS:
        if name == clock:
            return clock
    raise ValueError(f"a cell's clock is one of {_CLOCKS}, got {name!r}")

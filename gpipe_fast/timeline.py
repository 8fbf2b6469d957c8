"""The measured task timeline of one step: spans per cell, bubble, Chrome trace and picture."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Phase = Literal["forward", "backward"]
Kind = Literal["forward", "recompute", "backward", "copy"]
# What timed a cell's tasks: the steady clock on its worker, or CUDA events on its stream.
Clock = Literal["host", "cuda"]
_CLOCKS: tuple[Clock, ...] = ("host", "cuda")

_NS = 1e-9
_LETTER = {"forward": "F", "recompute": "R", "backward": "B", "copy": "C"}
_COLOUR = {
    "forward": "#4c72b0",
    "recompute": "#dd8452",
    "backward": "#55a868",
    "copy": "#8172b3",
}


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
    ``_C.gpipe_backward`` for "backward"). The "copy" kind is reserved for boundary copies
    timed on their own; gpipe_fast records none at present (a copy is part of its task).
    """

    phase: Phase
    kind: Kind
    cell: int
    microbatch: int
    start_s: float
    end_s: float
    task: int = -1

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Timeline:
    """The spans of one step's tasks: the forward run by ``pipe(x)`` and, once
    ``loss.backward()`` has run, the backward.

    Times are seconds of the steady clock (``time.monotonic``) after the start of the
    step's first task, so the backward's spans also contain the gap during which the
    caller's thread computed the loss and reached the pipe's backward; that gap belongs to
    no cell and is left out of :attr:`makespan` and :meth:`bubble`.

    ``clocks`` names, per cell, what timed its spans (see :class:`TaskSpan`): "host" on CPU
    cells, "cuda" (CUDA events on the cell's stream) on CUDA cells; empty when unknown.
    """

    cells: int
    microbatches: int
    spans: list[TaskSpan] = field(default_factory=list)
    clocks: tuple[Clock, ...] = ()

    @classmethod
    def from_runs(
        cls,
        runs: Sequence[tuple[Phase, Any, Iterable[tuple[int, int, int]]]],
        clocks: Sequence[str] = (),
    ) -> Timeline:
        """Builds the timeline from executor runs: (phase, schedule, ``last_spans()``), and
        optionally the executor's ``cell_clocks()``."""
        if not runs:
            raise ValueError("a timeline needs at least one run")
        cell_clocks = tuple(_clock(name) for name in clocks)
        if cell_clocks and len(cell_clocks) != runs[0][1].cells:
            raise ValueError(f"got {len(cell_clocks)} clocks for {runs[0][1].cells} cells")
        raw = [(phase, schedule, *span) for phase, schedule, spans in runs for span in spans]
        origin = min((start_ns for *_, start_ns, _end in raw), default=0)
        spans_out = []
        for phase, schedule, task_id, start_ns, end_ns in raw:
            task = schedule.tasks[task_id]
            spans_out.append(
                TaskSpan(
                    phase=phase,
                    kind=task.kind.name.lower(),
                    cell=task.cell,
                    microbatch=task.microbatch,
                    start_s=(start_ns - origin) * _NS,
                    end_s=(end_ns - origin) * _NS,
                    task=task_id,
                )
            )
        spans_out.sort(key=lambda s: (s.start_s, s.cell))
        first = runs[0][1]
        return cls(
            cells=first.cells, microbatches=first.microbatches, spans=spans_out, clocks=cell_clocks
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
        """Seconds the cells spent in the step: the forward phase's window (first task start
        to last task end) plus the backward phase's window, without the gap between them."""
        phases: tuple[Phase, ...] = ("forward", "backward")
        return sum((end - start for start, end in map(self.phase_window, phases)), 0.0)

    def busy(self, cell: int) -> float:
        """Seconds `cell` spent in tasks (copy spans lie inside tasks and are not added)."""
        if not 0 <= cell < self.cells:
            raise ValueError(f"cell must be in [0, {self.cells}), got {cell}")
        return sum(s.duration_s for s in self.spans if s.cell == cell and s.kind != "copy")

    def bubble(self) -> float:
        """Measured idle share of cell-time: ``1 - sum_k busy(k) / (cells * makespan)``.

        The phases are concatenated: each phase counts from its first task's start to its
        last task's end, and the gap between ``pipe(x)`` returning and the backward's first
        task (the loss, on the caller's thread) is not counted. Per-task overheads outside
        the tasks' spans (the executor's hand-offs) count as idle.
        """
        makespan = self.makespan
        if makespan <= 0:
            return 0.0
        busy = sum(self.busy(cell) for cell in range(self.cells))
        return max(0.0, 1.0 - busy / (self.cells * makespan))

    @property
    def ideal_bubble(self) -> float:
        """The fill-drain bubble of equal-cost cells with no overheads: (K-1)/(M+K-1)."""
        return (self.cells - 1) / (self.microbatches + self.cells - 1)

    # -- outputs -----------------------------------------------------------------------------

    def to_chrome_trace(self, path: str | Path) -> None:
        """Writes Chrome trace JSON (chrome://tracing, ui.perfetto.dev): one track per cell,
        one complete ("X") event per span, times in microseconds."""
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "gpipe_fast step"}}
        ]
        for cell in range(self.cells):
            track = {"ph": "M", "pid": 0, "tid": cell}
            events.append({**track, "name": "thread_name", "args": {"name": f"cell {cell}"}})
            events.append({**track, "name": "thread_sort_index", "args": {"sort_index": cell}})
        for span in self.spans:
            events.append(
                {
                    "name": f"{_LETTER[span.kind]}{span.microbatch}",
                    "cat": span.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": span.cell,
                    "ts": round(span.start_s * 1e6, 3),
                    "dur": round(span.duration_s * 1e6, 3),
                    "args": {
                        "microbatch": span.microbatch,
                        "kind": span.kind,
                        "phase": span.phase,
                        "task": span.task,
                        **({"clock": self.clocks[span.cell]} if self.clocks else {}),
                    },
                }
            )
        trace = {"traceEvents": events, "displayTimeUnit": "ms"}
        Path(path).write_text(json.dumps(trace, indent=None) + "\n")

    def plot(self, path: str | Path) -> None:
        """Draws the timeline as a PNG: one row per cell, tasks coloured by kind with their
        micro-batch numbers, idle time as bare row. Needs matplotlib (``gpipe_fast[plot]``)."""
        try:
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as error:
            raise ImportError(
                "Timeline.plot needs matplotlib: pip install matplotlib "
                "(or pip install 'gpipe_fast[plot]')"
            ) from error

        end = max((s.end_s for s in self.spans), default=0.0)
        scale = 1e3  # milliseconds on the axis
        figure = Figure(figsize=(12, 1.4 + 0.55 * self.cells), layout="constrained")
        axes = figure.add_subplot()
        height = 0.8
        label_min = end / 80  # blocks narrower than this carry no number
        for cell in range(self.cells):
            y = self.cells - 1 - cell  # cell 0 on top
            axes.broken_barh(
                [(0, end * scale)], (y - height / 2, height), facecolors="#eeeeee", zorder=0
            )
            for span in (s for s in self.spans if s.cell == cell):
                axes.broken_barh(
                    [(span.start_s * scale, span.duration_s * scale)],
                    (y - height / 2, height),
                    facecolors=_COLOUR[span.kind],
                    edgecolors="white",
                    linewidth=0.5,
                    zorder=2,
                )
                if span.duration_s >= label_min:
                    axes.text(
                        (span.start_s + span.duration_s / 2) * scale,
                        y,
                        str(span.microbatch),
                        ha="center",
                        va="center",
                        color="white",
                        fontsize=8 if self.microbatches < 20 else 6,
                        zorder=3,
                    )
        handles = [
            Patch(facecolor=_COLOUR[kind], label=kind.capitalize())
            for kind in ("forward", "recompute", "backward", "copy")
            if any(s.kind == kind for s in self.spans)
        ]
        handles.append(Patch(facecolor="#eeeeee", label="idle"))
        if self.gap_s > 0:
            gap_start = self.phase_window("forward")[1]
            axes.axvspan(
                gap_start * scale,
                (gap_start + self.gap_s) * scale,
                facecolor="none",
                edgecolor="#999999",
                hatch="//",
                zorder=1,
            )
            handles.append(
                Patch(facecolor="none", edgecolor="#999999", hatch="//", label="caller (loss)")
            )
        axes.set_yticks(range(self.cells))
        axes.set_yticklabels([f"cell {self.cells - 1 - y}" for y in range(self.cells)])
        axes.set_ylim(-0.6, self.cells - 0.4)
        axes.set_xlim(0, end * scale if end > 0 else 1)
        axes.set_xlabel("time since the step's first task (ms)")
        axes.set_title(
            f"gpipe_fast step timeline: K={self.cells} cells, M={self.microbatches} "
            f"micro-batches; bubble measured {self.bubble():.1%}, ideal {self.ideal_bubble:.1%}"
        )
        axes.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            frameon=False,
            fontsize=8,
        )
        figure.savefig(path, dpi=120)


def _clock(name: str) -> Clock:
    for clock in _CLOCKS:
        if name == clock:
            return clock
    raise ValueError(f"a cell's clock is one of {_CLOCKS}, got {name!r}")

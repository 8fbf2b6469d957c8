"""A balance with its predicted step: per-cell rows, the schedule's step time and bubble."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from gpipe_fast import _C
from gpipe_fast.balancing.balance import partition
from gpipe_fast.balancing.profile import layer_param_bytes
from gpipe_fast.planning.calibrate import calibrated
from gpipe_fast.planning.candidates import Candidate, Choice
from gpipe_fast.planning.memory import CellMemory, predict_memory
from gpipe_fast.planning.planner import Planner, micro_rows
from gpipe_fast.planning.predict import StageCosts, predict
from gpipe_fast.runtime.timeline import Timeline
from gpipe_fast.schedule.registry import schedule_kind

PLAN_COSTS = ("time", "size", "params")
PLAN_UNITS = {"time": "s", "size": "B", "params": "params"}


@dataclass
class CellPlan:
    """One cell of a plan."""

    index: int
    layers: range  # indices into the module
    names: list[str]  # the layers' names in the module
    cost: float  # in the plan's unit
    param_bytes: int
    activation_bytes: int  # the cell's output per micro-batch (mini-batch bytes / chunks)
    memory: CellMemory | None = None  # predicted bytes of a train_step on its device


@dataclass
class Plan:
    """A balance with what it is predicted to do: per-cell rows, and the step time and bubble
    the native simulator gives for a train_step of `schedule` (for "gpipe", also
    pipe(x) followed by its backward). Times are in the plan's `unit`: seconds for
    cost="time" (each cell timed on one micro-batch with its worker's thread count, plus
    the runtime's measured cost per task, `overhead`), otherwise the cost's own unit, so only
    their ratios mean anything. A plan calibrated from recorded steps (`calibrated`) takes
    each cell's costs and the overhead from them instead."""

    balance: list[int]
    chunks: int
    cost: str  # "time", "size" or "params"
    unit: str
    cells: list[CellPlan]
    forward_time: float  # when the last forward ends
    backward_time: float  # step_time - forward_time
    step_time: float  # the simulated makespan
    bubble: float  # idle share of all workers' time over the step
    schedule: str = "gpipe"
    overhead: float = 0.0  # per task, in the plan's unit (measured with cost="time")
    threads: int | None = None  # intra-op threads of each CPU cell the costs were timed with
    calibrated: bool = False  # costs and overhead read from recorded steps' timelines
    call_overhead: float = 0.0  # per step around its tasks (calibrated plans; in step_time)
    checkpoint: str = "never"
    optimizer: str | float | None = None  # whose state the memory counts
    dp: int = 1
    dp_shard: bool = False
    worker_memory: list[int] = field(default_factory=list)  # peak bytes per device (worker)
    memory_one_device: int = 0  # peak bytes with all cells on one device (one process's CPU)

    @property
    def memory(self) -> list[CellMemory]:
        """Each cell's predicted memory (see planning/memory.py)."""
        return [cell.memory for cell in self.cells if cell.memory is not None]

    @property
    def peak_memory(self) -> int:
        """The most bytes any device (worker) is predicted to hold during a train_step."""
        return max(self.worker_memory, default=0)

    def __str__(self) -> str:
        header = ("cell", "layers", "names", f"cost ({self.unit})", "params", "out/micro-batch",
                  "peak memory")  # fmt: skip
        rows = [header] + [
            (
                str(c.index),
                _span(c.layers),
                _names(c.names),
                f"{c.cost:.4g}",
                _human_bytes(c.param_bytes),
                _human_bytes(c.activation_bytes),
                _human_bytes(c.memory.peak) if c.memory else "-",
            )
            for c in self.cells
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            f"GPipe plan: {sum(self.balance)} layers in {len(self.balance)} cells, "
            f"{self.chunks} micro-batches, balanced by {self.cost}, schedule {self.schedule!r}, "
            f"checkpoint {self.checkpoint!r}"
        ]
        lines += [
            "  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]
        overhead = f", {self.overhead * 1e6:.0f} us per task" if self.cost == "time" else ""
        if self.calibrated:
            overhead += (
                f" and {self.call_overhead * 1e3:.3g} ms per step around the tasks, "
                "calibrated from recorded steps"
            )
        lines.append(
            f"predicted step {self.step_time:.4g} {self.unit} (last forward ends at "
            f"{self.forward_time:.4g}), bubble {self.bubble:.1%}{overhead}"
        )
        lines.append(self._memory_line())
        return "\n".join(lines)

    def _memory_line(self) -> str:
        sharded = f", dp {self.dp} sharded" if self.dp_shard else ""
        return (
            f"predicted peak memory {_human_bytes(self.peak_memory)} per device "
            f"({_human_bytes(self.memory_one_device)} with all cells on one), "
            f"optimizer {self.optimizer!r}{sharded}"
        )


def _span(layers: range) -> str:
    return str(layers.start) if len(layers) == 1 else f"{layers.start}-{layers.stop - 1}"


def _names(names: Sequence[str], limit: int = 32) -> str:
    text = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def evaluate(planner: Planner, balance: Sequence[int] | None, candidate: Candidate) -> Plan:
    """The plan of one candidate: its balance (the cost's, when None) and prediction."""
    costs = planner.layer_costs(candidate.chunks, candidate.schedule)
    workers = planner.workers(candidate.schedule)
    chosen = list(balance) if balance is not None else partition(costs.total, planner.cells)
    threads = planner.threads(candidate.schedule) if planner.cost == "time" else None
    overhead = planner.overhead(candidate.schedule, candidate.chunks)
    return _plan(planner, chosen, candidate, workers, costs.stages(chosen), overhead,
                 costs.total, threads=threads)  # fmt: skip


def calibrated_plan(
    planner: Planner,
    balance: Sequence[int] | None,
    choice: Choice,
    calibrate: Timeline | Sequence[Timeline],
) -> Plan:
    """The plan of the given balance with its cells' costs read from recorded timelines."""
    if balance is None:
        raise ValueError("calibrate: pass balance=, the balance of the pipe that recorded it")
    if planner.cost != "time":
        raise ValueError(f"calibrate: calibrating measures time, got cost={planner.cost!r}")
    if choice.budget is not None:
        raise ValueError("calibrate: give chunks, checkpoint and schedule, not memory_per_device")
    candidate = choice.only()
    calibration = calibrated(calibrate, planner.cells, candidate.chunks)
    if schedule_kind(candidate.schedule).split_backward and not calibration.split:
        warnings.warn(
            f"gf.plan: {candidate.schedule} calibrated from steps whose backwards were not "
            "split: each half is taken as half a backward, which underestimates small layers "
            f"(a split costs a task more); calibrate from a {candidate.schedule} step instead",
            stacklevel=3,
        )
    workers = planner.workers(candidate.schedule)
    return _plan(planner, list(balance), candidate, workers, calibration.costs,
                 calibration.handoff, _spread(calibration.costs, balance),
                 threads=planner.threads(candidate.schedule), call=calibration.call)  # fmt: skip


def fitted_plan(
    planner: Planner,
    balance: Sequence[int] | None,
    candidate: Candidate,
    scale: float,
    handoff: float,
    call: float,
) -> Plan:
    """The plan of a candidate with its profiled task costs times `scale`, `handoff` seconds
    per task and `call` per step: gf.plan as the steps a tuning measured calibrated it."""
    costs = planner.layer_costs(candidate.chunks, candidate.schedule)
    chosen = list(balance) if balance is not None else partition(costs.total, planner.cells)
    scaled = [c.scaled(scale) for c in costs.stages(chosen)]
    return _plan(planner, chosen, candidate, planner.workers(candidate.schedule), scaled,
                 handoff, [c * scale for c in costs.total],
                 threads=planner.threads(candidate.schedule), call=call)  # fmt: skip


def plan_with_costs(
    planner: Planner,
    balance: Sequence[int],
    candidate: Candidate,
    costs: Sequence[StageCosts],
    overhead: float,
    call: float,
) -> Plan:
    """The calibrated plan of `balance` with its cells' task costs as measured, `overhead`
    seconds per task between them and `call` seconds per step around them."""
    workers = planner.workers(candidate.schedule)
    return _plan(planner, list(balance), candidate, workers, costs, overhead,
                 _spread(costs, balance), threads=planner.threads(candidate.schedule),
                 call=call)  # fmt: skip


def _plan(
    planner: Planner,
    balance: list[int],
    candidate: Candidate,
    workers: int,
    stage_costs: Sequence[StageCosts],
    overhead: float,
    layer_costs: Sequence[float],
    *,
    threads: int | None,
    call: float | None = None,
) -> Plan:
    """The plan of `balance` with its step simulated from `stage_costs` and `overhead`, plus
    `call` seconds around the tasks when calibrated (None: not calibrated), and its memory
    walked in the simulated order."""
    steps = _C.make_schedule(candidate.schedule, len(balance), workers, candidate.chunks,
                             candidate.checkpoint)  # fmt: skip
    prediction = predict(steps, stage_costs, overhead)
    memory = predict_memory(steps, prediction.start, prediction.end, balance,
                            micro_rows(planner.sample, candidate.chunks),
                            planner.activations(), planner.params(),
                            batch_rows=micro_rows(planner.sample, 1), dp=candidate.dp,
                            dp_shard=candidate.dp_shard)  # fmt: skip
    around = call or 0.0
    return Plan(
        balance=balance,
        chunks=candidate.chunks,
        cost=planner.cost,
        unit=PLAN_UNITS[planner.cost],
        cells=_rows(planner, balance, layer_costs, candidate.chunks, memory.cells),
        forward_time=prediction.forward_time,
        backward_time=prediction.step_time + around - prediction.forward_time,
        step_time=prediction.step_time + around,
        bubble=prediction.bubble,
        schedule=candidate.schedule,
        overhead=overhead,
        threads=threads,
        calibrated=call is not None,
        call_overhead=around,
        checkpoint=candidate.checkpoint,
        optimizer=planner.optimizer,
        dp=candidate.dp,
        dp_shard=candidate.dp_shard,
        worker_memory=memory.workers,
        memory_one_device=memory.one_device,
    )


def _spread(costs: Sequence[StageCosts], balance: Sequence[int]) -> list[float]:
    """Per-layer costs whose cell sums are the measured cells' forward + backward of one
    micro-batch (what a profiled plan's rows show), spread evenly over the cell's layers."""
    layer_costs: list[float] = []
    for cell, size in zip(costs, balance, strict=True):
        layer_costs += [(cell.forward + cell.backward) / size] * size
    return layer_costs


def _rows(
    planner: Planner,
    balance: Sequence[int],
    layer_costs: Sequence[float],
    chunks: int,
    memory: Sequence[CellMemory],
) -> list[CellPlan]:
    return _cell_rows(planner.module, balance, layer_costs, planner.output_bytes(), chunks, memory)


def _cell_rows(
    module: nn.Sequential,
    balance: Sequence[int],
    layer_costs: Sequence[float],
    output_bytes: Sequence[int],
    chunks: int,
    memory: Sequence[CellMemory],
) -> list[CellPlan]:
    # Not named_children(): it skips repeats of one layer object, which still count as layers.
    names = list(module._modules)
    param_bytes = layer_param_bytes(module)
    rows, start = [], 0
    for index, size in enumerate(balance):
        layers = range(start, start + size)
        rows.append(
            CellPlan(
                index=index,
                layers=layers,
                names=names[layers.start : layers.stop],
                cost=float(sum(layer_costs[start : start + size])),
                param_bytes=sum(param_bytes[start : start + size]),
                activation_bytes=math.ceil(output_bytes[layers.stop - 1] / chunks),
                memory=memory[index],
            )
        )
        start += size
    return rows

"""A balance with its predicted step: per-cell rows, the schedule's step time and bubble."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gpipe_fast import _C
from gpipe_fast.arguments import (
    check_balance,
    check_choice,
    check_count,
    check_int,
    check_module,
)
from gpipe_fast.device.host import threads_per_cell
from gpipe_fast.nn.microbatch import as_tensors, scatter
from gpipe_fast.planning.balance import partition
from gpipe_fast.planning.calibrate import calibrated
from gpipe_fast.planning.predict import StageCosts, predict, task_overhead
from gpipe_fast.planning.profile import (
    BACKWARD_PER_FORWARD,
    Device,
    Sample,
    check_param_scale,
    layer_costs_by_params,
    layer_output_bytes,
    layer_param_bytes,
    profile_layers,
    resolve_device,
)
from gpipe_fast.runtime.timeline import Timeline
from gpipe_fast.schedule.registry import check_schedule, placement, schedule_kind

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

    def __str__(self) -> str:
        header = ("cell", "layers", "names", f"cost ({self.unit})", "params", "out/micro-batch")
        rows = [header] + [
            (
                str(c.index),
                _span(c.layers),
                _names(c.names),
                f"{c.cost:.4g}",
                _human_bytes(c.param_bytes),
                _human_bytes(c.activation_bytes),
            )
            for c in self.cells
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            f"GPipe plan: {sum(self.balance)} layers in {len(self.balance)} cells, "
            f"{self.chunks} micro-batches, balanced by {self.cost}, schedule {self.schedule!r}"
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
        return "\n".join(lines)


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


def _cell_sums(values: Sequence[float], balance: Sequence[int]) -> list[float]:
    sums, start = [], 0
    for size in balance:
        sums.append(float(sum(values[start : start + size])))
        start += size
    return sums


def _first_dim(tensors: Sequence[Tensor]) -> int:
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("sample must have a batch dimension (dim 0) on every tensor")
    return min(t.size(0) for t in tensors)


def plan(
    module: nn.Sequential,
    sample: Sample,
    partitions: int,
    chunks: int,
    *,
    balance: Sequence[int] | None = None,
    cost: str = "time",
    device: Device | None = None,
    checkpoint: str = "never",
    schedule: str = "gpipe",
    devices: int | None = None,
    warmup: int = 2,
    repeats: int = 5,
    param_scale: float = 2.0,
    calibrate: Timeline | Sequence[Timeline] | None = None,
) -> Plan:
    """Balances `module` into `partitions` cells by `cost` ("time", "size" or "params"; or takes
    the given `balance`) and predicts a training step of `schedule` on `sample`, a whole
    mini-batch that is split into `chunks` micro-batches. `devices`: how many devices (workers)
    the cells share, for the interleaved schedule (default: as the schedule places them: one
    per cell, two for zbv).

    With cost="time" each layer is timed as its cell will run it: on one micro-batch of the
    sample, on `device`, with the intra-op threads each CPU cell's worker gets (the cores
    shared by the CPU cells, as GPipe does); the zero-bubble schedule's backward halves are
    timed apart. The runtime's own cost per task (its hand-offs and Python work, measured by
    a step through cells that do nothing) is added to every task. The other costs stand for
    a layer's forward, its backward is taken as BACKWARD_PER_FORWARD times that, split in
    equal halves for zero bubble, and a task costs its cell's cost / chunks.

    `calibrate`: one or more timelines of steps recorded with `balance` (``pipe.timeline()``
    after ``pipe.record_timeline()``), of any schedule with the same cells and chunks. Each
    cell's task costs are then the recorded tasks' medians, the overhead per task is what
    the recorded step spent between its tasks, solved through the simulator, and what a
    train_step call spent around its tasks is added once (`call_overhead`); nothing is
    timed. It predicts another `schedule` from the step as it ran on this machine.
    """
    module = check_module(module)
    cells = check_count(partitions, "partitions", len(module))
    chunks = check_int(chunks, "chunks", 1)
    cost = check_choice(cost, "cost", PLAN_COSTS)
    checkpoint = check_choice(checkpoint, "checkpoint", ("always", "except_last", "never"))
    schedule = check_schedule(schedule)
    workers = _plan_workers(schedule, cells, devices)
    if balance is not None:
        balance = check_balance(balance, len(module), cells=cells)
    if calibrate is not None:
        if balance is None:
            raise ValueError("calibrate: pass balance=, the balance of the pipe that recorded it")
        if cost != "time":
            raise ValueError(f"calibrate: calibrating measures time, got cost={cost!r}")
    batch = _first_dim(as_tensors(sample, "sample"))
    if chunks > batch:
        raise ValueError(f"chunks ({chunks}) must not exceed the sample's batch size ({batch})")

    output_bytes = layer_output_bytes(module, sample, device=device)
    threads: int | None = None
    overhead = 0.0
    split = schedule_kind(schedule).split_backward
    if calibrate is not None:
        assert balance is not None
        calibration = calibrated(calibrate, cells, chunks)
        if split and not calibration.split:
            warnings.warn(
                f"gf.plan: {schedule} calibrated from steps whose backwards were not split: "
                "each half is taken as half a backward, which underestimates small layers "
                f"(a split costs a task more); calibrate from a {schedule} step instead",
                stacklevel=2,
            )
        return _plan(module, list(balance), chunks, cost, schedule, checkpoint, workers,
                     calibration.costs, calibration.handoff,
                     _spread(calibration.costs, balance), output_bytes,
                     threads=_cell_threads(workers, device, module),
                     call=calibration.call)  # fmt: skip
    if cost == "time":
        threads = _cell_threads(workers, device, module)
        microbatch = scatter(sample, chunks)[0]
        with _intra_op_threads(threads):
            profile = profile_layers(
                module, microbatch, device=device, warmup=warmup, repeats=repeats, split=split
            )
        forward, backward = profile.forward, profile.backward
        backward_input = profile.backward_input or [b / 2 for b in backward]
        backward_weight = profile.backward_weight or [b / 2 for b in backward]
        layer_costs = profile.costs("total")
        overhead = task_overhead(cells, workers, chunks, schedule)
    else:
        if cost == "size":
            scale = check_param_scale(param_scale)
            layer_costs = [
                out + scale * params
                for out, params in zip(output_bytes, layer_param_bytes(module), strict=True)
            ]
        else:
            layer_costs = layer_costs_by_params(module)
        forward = [c / chunks for c in layer_costs]
        backward = [BACKWARD_PER_FORWARD * c for c in forward]
        backward_input = backward_weight = [b / 2 for b in backward]
    if balance is None:
        balance = partition(layer_costs, cells)

    stage_costs = [
        StageCosts(forward=f, backward=b, backward_input=bi, backward_weight=bw)
        for f, b, bi, bw in zip(
            *(_cell_sums(v, balance) for v in (forward, backward, backward_input, backward_weight)),
            strict=True,
        )
    ]
    return _plan(module, list(balance), chunks, cost, schedule, checkpoint, workers,
                 stage_costs, overhead, layer_costs, output_bytes, threads=threads)  # fmt: skip


def _plan_workers(schedule: str, cells: int, devices: object) -> int:
    """The workers (devices) the cells share: `devices`, or by default as many as the kind
    runs `cells` cells on (one per cell; cells / 2 for zbv); checked against the kind's rule,
    ValueError naming the argument that does not fit."""
    per = schedule_kind(schedule).stages_per_worker
    if devices is None:
        workers, argument = max(1, cells // per) if per else cells, "partitions"
    else:
        workers, argument = check_int(devices, "devices", 1), "devices"
    try:
        placement(schedule, cells, workers)
    except ValueError as error:
        raise ValueError(f"{argument}: {error}") from None
    return workers


def _plan(
    module: nn.Sequential,
    balance: list[int],
    chunks: int,
    cost: str,
    schedule: str,
    checkpoint: str,
    workers: int,
    stage_costs: Sequence[StageCosts],
    overhead: float,
    layer_costs: Sequence[float],
    output_bytes: Sequence[int],
    *,
    threads: int | None,
    call: float | None = None,
) -> Plan:
    """The plan of `balance` with its step simulated from `stage_costs` and `overhead`, plus
    `call` seconds around the tasks when calibrated (None: not calibrated)."""
    steps = _C.make_schedule(schedule, len(balance), workers, chunks, checkpoint)
    prediction = predict(steps, stage_costs, overhead)
    around = call or 0.0
    return Plan(
        balance=balance,
        chunks=chunks,
        cost=cost,
        unit=PLAN_UNITS[cost],
        cells=_cell_rows(module, balance, layer_costs, output_bytes, chunks),
        forward_time=prediction.forward_time,
        backward_time=prediction.step_time + around - prediction.forward_time,
        step_time=prediction.step_time + around,
        bubble=prediction.bubble,
        schedule=schedule,
        overhead=overhead,
        threads=threads,
        calibrated=call is not None,
        call_overhead=around,
    )


def _spread(costs: Sequence[StageCosts], balance: Sequence[int]) -> list[float]:
    """Per-layer costs whose cell sums are the measured cells' forward + backward of one
    micro-batch (what a profiled plan's rows show), spread evenly over the cell's layers."""
    layer_costs: list[float] = []
    for cell, size in zip(costs, balance, strict=True):
        layer_costs += [(cell.forward + cell.backward) / size] * size
    return layer_costs


def _cell_threads(cells: int, device: Device | None, module: nn.Module) -> int | None:
    """The intra-op threads of each CPU cell's worker, as GPipe sets them (None: CUDA cells,
    or OMP_NUM_THREADS set, which GPipe leaves alone)."""
    target = resolve_device(device, module)
    return threads_per_cell([target] * cells).per_cell


@contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _cell_rows(
    module: nn.Sequential,
    balance: Sequence[int],
    layer_costs: Sequence[float],
    output_bytes: Sequence[int],
    chunks: int,
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
            )
        )
        start += size
    return rows

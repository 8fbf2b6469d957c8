"""A balance with its predicted pipeline: per-cell rows and the simulated step time and bubble."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from gpipe_fast import _C
from gpipe_fast.balance import (
    BACKWARD_PER_FORWARD,
    Device,
    Sample,
    _check_balance,
    _check_choice,
    _check_count,
    _check_int,
    _check_module,
    _check_param_scale,
    layer_costs_by_params,
    layer_output_bytes,
    layer_param_bytes,
    partition,
    profile_layers,
)
from gpipe_fast.checkpoint import recomputed_microbatches
from gpipe_fast.microbatch import as_tensors
from gpipe_fast.schedules import ACTIONS

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
    the native simulator gives for a GPipe fill-drain step (forward then backward, no
    recomputation). Times are in the plan's `unit`: seconds for cost="time", otherwise the
    cost's own unit, so only their ratios mean anything."""

    balance: list[int]
    chunks: int
    cost: str  # "time", "size" or "params"
    unit: str
    cells: list[CellPlan]
    forward_time: float
    backward_time: float
    step_time: float  # forward_time + backward_time
    bubble: float  # idle share of all cells' time over the step

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
            f"{self.chunks} micro-batches, balanced by {self.cost}"
        ]
        lines += [
            "  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]
        lines.append(
            f"predicted step {self.step_time:.4g} {self.unit} (forward "
            f"{self.forward_time:.4g} + backward {self.backward_time:.4g}), "
            f"bubble {self.bubble:.1%}"
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


def _predict_step(
    forward: Sequence[float], backward: Sequence[float], chunks: int, recompute: Sequence[bool]
) -> tuple[float, float, float]:
    """Forward and backward makespans of a fill-drain step given each cell's mini-batch
    forward and backward cost (a micro-batch task costs 1/chunks of it; a Recompute task as
    much as its forward), and the bubble: the share of all cells' time over both phases that
    is idle."""
    cells = len(forward)
    forward_schedule = _C.gpipe_forward(cells, chunks)
    backward_schedule = _C.gpipe_backward(cells, chunks, list(recompute))
    per_task = {
        "forward": [f / chunks for f in forward],
        "recompute": [f / chunks for f in forward],
        "backward": [b / chunks for b in backward],
    }
    times, busy = [], 0.0
    for schedule in (forward_schedule, backward_schedule):
        costs = [per_task[ACTIONS[task.action]][task.stage] for task in schedule.tasks]
        times.append(float(_C.simulate(schedule, costs).makespan))
        busy += sum(costs)
    step = times[0] + times[1]
    bubble = 1.0 - busy / (cells * step) if step > 0.0 else 0.0
    return times[0], times[1], bubble


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
    warmup: int = 2,
    repeats: int = 5,
    param_scale: float = 2.0,
) -> Plan:
    """Balances `module` into `partitions` cells by `cost` ("time", "size" or "params"; or takes
    the given `balance`) and predicts a step on `sample`, a whole mini-batch that is split into
    `chunks` micro-batches.

    With cost="time" the measured forward and backward times are simulated as they are; the
    other costs stand for a layer's forward and its backward is taken as BACKWARD_PER_FORWARD
    times that. `checkpoint` is the GPipe mode to predict: recomputed micro-batches add a
    Recompute task (one more forward) before their backward.
    """
    module = _check_module(module)
    cells = _check_count(partitions, "partitions", len(module))
    chunks = _check_int(chunks, "chunks", 1)
    cost = _check_choice(cost, "cost", PLAN_COSTS)
    checkpoint = _check_choice(checkpoint, "checkpoint", ("always", "except_last", "never"))
    if balance is not None:
        balance = _check_balance(balance, cells, len(module))
    batch = _first_dim(as_tensors(sample, "sample"))
    if chunks > batch:
        raise ValueError(f"chunks ({chunks}) must not exceed the sample's batch size ({batch})")

    if cost == "time":
        profile = profile_layers(module, sample, device=device, warmup=warmup, repeats=repeats)
        forward, backward = profile.forward, profile.backward
        output_bytes = profile.output_bytes
        layer_costs = profile.costs("total")
    else:
        output_bytes = layer_output_bytes(module, sample, device=device)
        if cost == "size":
            scale = _check_param_scale(param_scale)
            layer_costs = [
                out + scale * params
                for out, params in zip(output_bytes, layer_param_bytes(module), strict=True)
            ]
        else:
            layer_costs = layer_costs_by_params(module)
        forward = layer_costs
        backward = [BACKWARD_PER_FORWARD * c for c in layer_costs]
    if balance is None:
        balance = partition(layer_costs, cells)

    forward_time, backward_time, bubble = _predict_step(
        _cell_sums(forward, balance),
        _cell_sums(backward, balance),
        chunks,
        recomputed_microbatches(checkpoint, chunks),
    )
    return Plan(
        balance=list(balance),
        chunks=chunks,
        cost=cost,
        unit=PLAN_UNITS[cost],
        cells=_cell_rows(module, balance, layer_costs, output_bytes, chunks),
        forward_time=forward_time,
        backward_time=backward_time,
        step_time=forward_time + backward_time,
        bubble=bubble,
    )


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

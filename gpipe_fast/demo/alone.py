"""The demo's cells timed alone, outside the pipe: each kind of task's cost, as the planner's."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

import gpipe_fast as gf
from gpipe_fast.balancing.profile import input_gradient, timed, weight_gradient
from gpipe_fast.device.host import intra_op_threads
from gpipe_fast.nn.microbatch import scatter
from gpipe_fast.planning.predict import StageCosts
from gpipe_fast.schedule.registry import schedule_kind
from gpipe_fast.skip import CellSkipTracker, SkipLayout, inspect_skip_layout, use_skip_tracker

LossFn = Callable[[Tensor, Tensor], Tensor]


def time_cell_alone(
    cell: nn.Module,
    sample: Tensor,
    needs_input_grad: bool,
    threads: int | None,
    repeats: int = 5,
    split: bool = False,
) -> StageCosts:
    """Times `cell` on `sample` (one micro-batch, on the cell's device) on this thread with
    `threads` intra-op threads, as the cell's worker runs it: the medians of `repeats` runs
    after one warm-up; with `split`, the backward's two halves too (the input's gradient,
    then the weights'). The backward accumulates into the cell's .grad; zero it afterwards."""
    device = sample.device
    params = [p for p in cell.parameters() if p.requires_grad]
    passes = ("forward", "forward_grad", "backward", "backward_input", "backward_weight")
    times: dict[str, list[float]] = {name: [] for name in passes}
    with intra_op_threads(threads):
        for _ in range(repeats + 1):
            with torch.no_grad():
                times["forward"].append(timed(device, cell, sample)[0])
            leaf = sample.detach().requires_grad_(needs_input_grad or split)
            with torch.enable_grad():
                seconds, output = timed(device, cell, leaf)
            times["forward_grad"].append(seconds)
            grad = torch.ones_like(output)
            if split:
                halves = [output], [grad]
                times["backward_input"].append(timed(device, input_gradient, *halves, leaf)[0])
                weights = timed(device, weight_gradient, *halves, params)[0] if params else 0.0
                times["backward_weight"].append(weights)
            else:
                times["backward"].append(timed(device, torch.autograd.backward, output, grad)[0])
    medians = {name: statistics.median(runs[1:]) for name, runs in times.items() if runs}
    if split:  # the whole backward, as the simulator prices an unsplit one
        medians["backward"] = medians["backward_input"] + medians["backward_weight"]
    return StageCosts(
        forward=medians["forward_grad"],
        forward_no_grad=medians["forward"],
        backward=medians["backward"],
        backward_input=medians.get("backward_input", 0.0),
        backward_weight=medians.get("backward_weight", 0.0),
    )


def time_loss_alone(output: Tensor, target: Tensor, loss_fn: LossFn, repeats: int = 5) -> float:
    """Seconds of `loss_fn` on one micro-batch's output and its gradient (median)."""
    runs = []
    for _ in range(repeats + 1):
        leaf = output.detach().requires_grad_(True)
        runs.append(timed(output.device, _loss_and_gradient, loss_fn, leaf, target)[0])
    return statistics.median(runs[1:])


def _loss_and_gradient(loss_fn: LossFn, output: Tensor, target: Tensor) -> None:
    with torch.enable_grad():
        loss_fn(output, target).backward()


def median_costs(runs: Sequence[StageCosts]) -> StageCosts:
    """Each pass's median over several timings of one cell (a pass none of them timed stays
    unknown)."""
    medians: dict[str, Any] = {}
    for field in dataclasses.fields(StageCosts):
        values = [getattr(r, field.name) for r in runs if getattr(r, field.name) is not None]
        medians[field.name] = statistics.median(values) if values else None
    return StageCosts(**medians)


class _WithSkips(nn.Module):
    """A cell run alone with the skips that earlier cells stashed for it (a fresh tracker per
    call, so every run pops them again); what it stashes for later cells is dropped."""

    def __init__(self, cell: nn.Module, layout: SkipLayout, k: int, received: dict[Any, Any]):
        super().__init__()
        self.cell, self.layout, self.k, self.received = cell, layout, k, received

    def forward(self, x: Tensor) -> Tensor:
        with use_skip_tracker(CellSkipTracker(self.layout, self.k, self.received)):
            return self.cell(x)  # type: ignore[no-any-return]


def time_cells_alone(
    pipe: gf.GPipe,
    batch: Tensor,
    repeats: int = 5,
    loss: tuple[Tensor, LossFn] | None = None,
) -> list[StageCosts]:
    """Each cell of `pipe` timed alone on the first micro-batch of `batch` (its input, and the
    skips it pops, made by the cells before it), with the pipe's threads per cell, and with
    the backward split in halves when the pipe's schedule splits it; with `loss` (the batch's
    target and the loss function), the last cell's loss too. Leaves the cells' .grad
    zeroed."""
    sample = scatter(batch, pipe.chunks)[0]
    assert isinstance(sample, Tensor)
    layout = inspect_skip_layout([cast(nn.Sequential, cell) for cell in pipe.partitions])
    split = bool(schedule_kind(pipe.schedule).split_backward)
    stashed: dict[Any, Any] = {}  # the skips cells stashed for later ones, by key
    costs = []
    for k, cell in enumerate(pipe.partitions):
        sample = sample.to(pipe.devices[k])
        received = {key: stashed[key] for key in layout.receives(k)}
        timed = _WithSkips(cell, layout, k, received)
        # A cell's input needs a gradient when a cell before it learns (as in the pipe).
        costs.append(time_cell_alone(timed, sample, k > 0, pipe.threads_per_cell, repeats, split))
        tracker = CellSkipTracker(layout, k, received)
        with torch.no_grad(), use_skip_tracker(tracker):
            sample = cell(sample)
        stashed.update(tracker.outgoing)
    if loss is not None:
        target, loss_fn = loss
        first = scatter(target, pipe.chunks)[0]
        assert isinstance(first, Tensor)
        seconds = time_loss_alone(sample, first.to(sample.device), loss_fn, repeats)
        costs[-1] = dataclasses.replace(costs[-1], loss=seconds)
    pipe.zero_grad(set_to_none=True)
    return costs

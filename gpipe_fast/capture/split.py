"""Split points chosen for the user: among the model's repeated blocks, by parameters or time."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from gpipe_fast.capture.copies import planning_copy
from gpipe_fast.capture.discover import _record, as_inputs, repeated_blocks

Partition = Callable[[list[float], int], list[int]]
SPLIT_BY = ("params", "time")


def choose_split_points(
    model: nn.Module, example: Any, stages: int, partition: Partition, split_by: str = "params"
) -> list[str]:
    """Split points giving `stages` stages of the model's repeated blocks, balancing their
    parameter counts (`split_by="params"`) or their measured forward times ("time").
    `partition(costs, k)` gives the blocks per stage."""
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {stages!r}")
    if split_by not in SPLIT_BY:
        raise ValueError(f"split_by must be one of {SPLIT_BY}, got {split_by!r}")
    if split_by == "time":
        order, costs = _by_time(model, example)
    else:
        order, costs = _by_params(model, example)
    if stages == 1:
        return []
    if len(order) < stages:
        raise ValueError(
            f"num_stages={stages}: the model's forward calls {len(order)} repeated blocks "
            f"({', '.join(order) or 'none'}); give split_points yourself"
        )
    points, at = [], 0
    for size in partition(costs, stages)[:-1]:
        at += size
        points.append(order[at])
    return points


def _block_names(model: nn.Module) -> dict[int, str]:
    """The outermost repeated blocks (a T5 block's own list of layers is inside one)."""
    names = repeated_blocks(model)
    outer = [n for n in names if not any(n.startswith(f"{m}.") for m in names)]
    return {id(model.get_submodule(name)): name for name in outer}


def _by_params(model: nn.Module, example: Any) -> tuple[list[str], list[float]]:
    """The blocks in call order and their parameter counts: what the forward calls before the
    first block goes with it, the rest of the model with the last."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = planning_copy(model, mode)
    with mode:
        events = _record(model, pytree.tree_map_only(Tensor, mode.from_tensor, as_inputs(example)))
    blocks = _block_names(model)
    order = list(dict.fromkeys(blocks[id(e.module)] for e in events if id(e.module) in blocks))
    if not order:
        return [], []
    in_blocks = {id(p) for name in order for p in model.get_submodule(name).parameters()}
    first = next(e.start for e in events if blocks.get(id(e.module)) == order[0])
    early = {id(p): p for e in events[:first] for p in e.module.parameters(recurse=False)}
    before = sum(p.numel() for key, p in early.items() if key not in in_blocks)
    rest = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    costs = [float(sum(p.numel() for p in model.get_submodule(n).parameters())) for n in order]
    costs[0] += before
    costs[-1] += rest - before
    return order, costs


def _by_time(model: nn.Module, example: Any, repeats: int = 3) -> tuple[list[str], list[float]]:
    """The blocks in call order and the median time of each one's forward on `example`, run
    for real (evaluation mode, no gradient: nothing in the model changes). The time before the
    first block goes with it, the time after the last with the last. Forward times stand for
    the step's: a layer's backward costs about twice its forward."""
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"split_by='time' runs the model, but {meta[0]!r} is on the meta device; "
            "materialise the model first, or split by 'params'"
        )
    args, kwargs = as_inputs(example)
    blocks = _block_names(model)
    calls: list[tuple[str, float, float]] = []  # this run's block calls: name, start, end
    started: list[float] = []

    def pre(_module: nn.Module, _args: Any) -> None:
        started.append(time.perf_counter())

    def post(module: nn.Module, _args: Any, _output: Any) -> None:
        calls.append((blocks[id(module)], started.pop(), time.perf_counter()))

    modules = [model.get_submodule(name) for name in blocks.values()]
    hooks = [m.register_forward_pre_hook(pre) for m in modules]
    hooks += [m.register_forward_hook(post) for m in modules]
    training = model.training
    runs: list[tuple[dict[str, float], float, float]] = []  # per block, before, after
    try:
        model.eval()
        with torch.no_grad():
            for _ in range(repeats + 1):  # the first run warms up, and is not counted
                calls.clear()
                begin = time.perf_counter()
                model(*args, **kwargs)
                end = time.perf_counter()
                if not calls:
                    return [], []
                spent: dict[str, float] = {}
                for name, start, stop in sorted(calls, key=lambda call: call[1]):
                    spent[name] = spent.get(name, 0.0) + stop - start
                runs.append((spent, min(c[1] for c in calls) - begin,
                             end - max(c[2] for c in calls)))  # fmt: skip
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    runs = runs[1:]
    order = list(runs[0][0])  # in call order
    costs = [statistics.median(run[0][name] for run in runs) for name in order]
    costs[0] += statistics.median(run[1] for run in runs)
    costs[-1] += statistics.median(run[2] for run in runs)
    return order, costs

"""A step's inputs checked and split: micro-batches, targets, loss weights, each rank's share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gpipe_fast.nn.microbatch import Value, as_tensors, batch_size, scatter, split_sizes

if TYPE_CHECKING:
    from gpipe_fast.runtime.pipeline import Pipeline

REDUCTIONS = ("mean", "sum")


def check_loss_arguments(loss_fn: object, reduction: object) -> None:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def loss_weights(batch: int, total: int, chunks: int, reduction: str) -> list[float]:
    """Each micro-batch's loss weight: its share of the `total` batch (over every replica)
    for a mean, 1 for a sum."""
    sizes = split_sizes(batch, chunks)
    return [n / total for n in sizes] if reduction == "mean" else [1.0] * len(sizes)


def scatter_target(target: Any, batch: int, chunks: int) -> list[Any]:
    """The target split like the input (same micro-batch sizes); ValueError naming `target`
    when its batch differs."""
    tensors = as_tensors(target, "target")
    size = batch_size(tensors, "target")
    if size != batch:
        raise ValueError(f"target has batch size {size} (dim 0) but input has {batch}")
    return scatter(target, chunks)


@dataclass(frozen=True)
class RankShare:
    """What this process brings to a step across processes: the input's tensors and
    micro-batches (empty without cell 0), the targets (None without the last cell), and the
    batch sizes the ranks agreed on: this pipeline's, and the total over every replica."""

    given: tuple[Tensor, ...]
    microbatches: list[Value]
    targets: list[Any]
    batch: int
    total: int

    @property
    def count(self) -> int:
        return len(self.targets)


def rank_share(
    pipeline: Pipeline, input: Value | None, target: Any, chunks: int, *, needs_target: bool
) -> RankShare:
    """This rank's share of a step: cell 0's rank needs `input` (and tells the others its
    batch size), the last cell's rank `target` when `needs_target`; the others may pass
    None. Refuses a step after a failed one."""
    layout, groups = pipeline.layout, pipeline.groups
    assert groups is not None, "a step across processes needs the pipe's process groups"
    groups.check_usable()
    first, last = layout.is_local(0), layout.is_local(layout.stages - 1)
    if first and input is None:
        raise ValueError(f"input: rank {layout.pp_index} runs cell 0 and needs it")
    if needs_target and last and target is None:
        raise ValueError(f"target: rank {layout.pp_index} runs the last cell and needs it")
    given = as_tensors(input, "input") if first else ()
    try:
        batch, total = groups.batch(batch_size(given, "input") if first else None)
    except BaseException as error:
        pipeline.task_failed(error)
        raise
    count = len(split_sizes(batch, chunks))
    with torch.no_grad():
        microbatches = scatter(input, chunks) if first and input is not None else []
        targets = scatter_target(target, batch, chunks) if needs_target and last else [None] * count
    return RankShare(given, microbatches, targets, batch, total)

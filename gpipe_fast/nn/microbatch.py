"""Splits a mini-batch (and its target) into micro-batches along dim 0, joins results back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from gpipe_fast.nn.items import Counting, StepItems, count_items, step_items
from gpipe_fast.nn.pytree import Tree, is_plain, leaf_names, tensors_of, with_tensors

# The pipe's input (and target): a Tensor or a tuple of Tensors, split along dim 0. What
# cells return and pass on may be any pytree (gpipe_fast.nn.pytree.Tree).
Value = Tensor | tuple[Tensor, ...]


def as_tensors(value: object, what: str) -> tuple[Tensor, ...]:
    """The tensors of a Value; TypeError naming `what` for anything else."""
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, tuple) and value and all(isinstance(t, Tensor) for t in value):
        return value
    raise TypeError(
        f"{what} must be a Tensor or a non-empty tuple of Tensors, got {_describe(value)}"
    )


def like(tensors: tuple[Tensor, ...] | list[Tensor], template: Value) -> Value:
    """Packs tensors back into the shape of `template` (a lone Tensor or a tuple)."""
    return tuple(tensors) if isinstance(template, tuple) else tensors[0]


def batch_size(tensors: tuple[Tensor, ...], what: str) -> int:
    """The common size of dim 0; ValueError naming `what` when they differ or are scalars."""
    sizes = set()
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise ValueError(f"{what}[{i}] is a scalar tensor; every tensor needs a batch dim 0")
        sizes.add(t.size(0))
    if len(sizes) != 1:
        raise ValueError(f"{what} tensors have different batch sizes (dim 0): {sorted(sizes)}")
    return sizes.pop()


def split_sizes(n: int, chunks: int) -> list[int]:
    """Near-equal micro-batch sizes for n samples: min(chunks, n) parts, none empty."""
    parts = min(chunks, n)
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def scatter(value: Value, chunks: int) -> list[Value]:
    """Splits every tensor of `value` along dim 0 into near-equal micro-batches."""
    tensors = as_tensors(value, "input")
    for i, t in enumerate(tensors):
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"input[{i}] is on device {t.device}; gpipe_fast takes cpu or cuda tensors "
                "(it moves them to the first cell's device)"
            )
    n = batch_size(tensors, "input")
    if n == 0:
        raise ValueError("input has an empty batch (dim 0 is 0)")
    sizes = split_sizes(n, chunks)
    pieces = [t.split(sizes) for t in tensors]
    return [like([p[m] for p in pieces], value) for m in range(len(sizes))]


def gather(values: list[Tree], what: str = "output") -> Tree:
    """Joins micro-batch results leaf by leaf: tensors concatenated along dim 0 (no copy for
    a single micro-batch), any other leaf (an int, a string, None, ...) kept as it is, which
    it must be in every micro-batch.

    Every micro-batch's result must have the same structure, each tensor a batch dim 0 shared
    by the result's tensors, the same dtypes and equal other leaves: ValueError/TypeError
    naming `what` and the leaf otherwise (a dtype that changed between micro-batches is an
    error, never silently promoted)."""
    first = values[0]
    if not is_plain(first):
        _check_same_structure(values, what)
    rows = [tensors_of(v) for v in values]
    names = leaf_names(first, what)
    for m, row in enumerate(rows):
        if len(row) != len(rows[0]):
            raise TypeError(
                f"{what} of micro-batch {m} has {len(row)} tensors but that of micro-batch 0 "
                f"has {len(rows[0])}"
            )
        for i, t in enumerate(row):
            if t.dim() == 0:
                raise ValueError(
                    f"{names[i]} is a scalar tensor (micro-batch {m}); every tensor needs a "
                    "batch dim 0"
                )
        sizes = sorted({t.size(0) for t in row})
        if len(sizes) > 1:
            raise ValueError(
                f"{what} tensors have different batch sizes (dim 0) in micro-batch {m}: {sizes}"
            )
        for i, (t, head) in enumerate(zip(row, rows[0], strict=True)):
            if t.dtype != head.dtype:
                raise TypeError(
                    f"{names[i]} has dtype {head.dtype} in micro-batch 0 but {t.dtype} in "
                    f"micro-batch {m}; a cell must return the same dtypes for every micro-batch"
                )
    if len(values) == 1:
        return first
    return with_tensors(first, [torch.cat(column) for column in zip(*rows, strict=True)])


def _check_same_structure(values: list[Tree], what: str) -> None:
    """Every micro-batch's result has the first one's structure, tensors in the same places
    and equal other leaves (which gather keeps once)."""
    paths, spec = pytree.tree_flatten_with_path(values[0])
    for m, value in enumerate(values[1:], start=1):
        leaves, other = pytree.tree_flatten(value)
        if other != spec:
            raise TypeError(
                f"{what} of micro-batch {m} has another structure than that of micro-batch 0 "
                f"({other} against {spec}); a cell must return the same structure for every "
                "micro-batch"
            )
        for (path, head), leaf in zip(paths, leaves, strict=True):
            name = f"{what}{pytree.keystr(path)}"
            if isinstance(head, Tensor) != isinstance(leaf, Tensor):
                raise TypeError(
                    f"{name} is a {type(head).__name__} in micro-batch 0 but a "
                    f"{type(leaf).__name__} in micro-batch {m}"
                )
            if not isinstance(head, Tensor) and not _equal(head, leaf):
                raise ValueError(
                    f"{name} is {head!r} in micro-batch 0 but {leaf!r} in micro-batch {m}: a "
                    "value other than a tensor is not joined across micro-batches, so the "
                    "pipe's output may hold one only when it is the same in every micro-batch"
                )


def _equal(a: object, b: object) -> bool:
    """Whether two leaves are the same value (one whose == is no plain bool is not)."""
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return "tuple(" + ", ".join(type(v).__name__ for v in value) + ")"
    return type(value).__name__


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
class BatchShare:
    """What this process brings to a step: the input's tensors and micro-batches (empty
    without cell 0), the targets (None each without the last cell, or without a target),
    the batch sizes (this pipeline's, and the total over every replica) and, for a loss
    that averages over counted items, the items (None: the loss weighs rows)."""

    given: tuple[Tensor, ...]
    microbatches: list[Value]
    targets: list[Any]
    batch: int
    total: int
    items: StepItems | None = None

    @property
    def count(self) -> int:
        return len(self.targets)


def whole_batch(
    input: Value | None,
    target: Any,
    chunks: int,
    *,
    needs_target: bool,
    counting: Counting | None = None,
) -> BatchShare:
    """A step's share in one process: the whole batch and, when `needs_target`, its target;
    with `counting`, the items of each micro-batch."""
    given = as_tensors(input, "input")
    batch = batch_size(given, "input")
    items = None
    with torch.no_grad():
        microbatches = scatter(given[0] if isinstance(input, Tensor) else given, chunks)
        targets = (
            scatter_target(target, batch, chunks) if needs_target else [None] * len(microbatches)
        )
        if counting is not None and counting.count is not None:
            counted = count_items(
                counting.count, targets if counting.source == "target" else microbatches
            )
            items = step_items(counted, sum(counted), counting.given)
    return BatchShare(given, microbatches, targets, batch, batch, items)

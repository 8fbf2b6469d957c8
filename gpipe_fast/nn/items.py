"""Losses that average over counted items (tokens whose label is not -100): gf.ItemMean.

The items each micro-batch counts, and the weights that make the whole batch's mean of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# One micro-batch's target (or, for a model's own loss, its labels) -> the items it counts.
CountFn = Callable[[Any], "int | Tensor"]


@dataclass(frozen=True)
class ItemMean:
    """``reduction=gf.ItemMean()``: ``loss_fn`` returns its micro-batch's mean over the items
    it counts, as ``nn.CrossEntropyLoss(ignore_index=-100)`` averages over the targets that
    are not -100; the pipe weights each micro-batch's mean by its share of the items of the
    whole batch (over every replica), so that the loss and the gradients equal ``loss_fn``'s
    on the whole batch however unevenly the micro-batches hold items. A micro-batch without
    any weighs nothing (its mean, 0/0, is not used).

    The items of a micro-batch are its target's entries that are not ``ignore_index``; give
    ``count`` (one micro-batch's target -> its number of items, an int or a 0-dim tensor)
    when they are others: a loss that shifts its target (``lambda y: (y[:, 1:] != -100)
    .sum()``), or a target that is a tuple. For a model that computes its own loss from
    ``labels`` in its inputs (``gf.pipeline``, ``target=None``) the items are those labels,
    counted as the model counts them, and ``count`` gets one micro-batch's ``labels``."""

    ignore_index: int = -100
    count: CountFn | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(
                f"ItemMean: ignore_index must be an int, got {type(self.ignore_index).__name__}"
            )
        if self.count is not None and not callable(self.count):
            raise TypeError(
                f"ItemMean: count must be callable or None, got {type(self.count).__name__}"
            )

    def counter(self) -> CountFn:
        """What counts one micro-batch's target: `count`, or its entries not ignore_index."""
        if self.count is not None:
            return self.count
        ignore_index = self.ignore_index

        def count(target: Any) -> Tensor:
            if not isinstance(target, Tensor):
                raise TypeError(
                    "reduction=gf.ItemMean() counts the target's entries that are not "
                    f"ignore_index, but the target is a {type(target).__name__}: give "
                    "ItemMean(count=...) to count its items"
                )
            return (target != ignore_index).sum()

        return count


@dataclass(frozen=True)
class Counting:
    """How a step counts the items its loss averages over. `source` "target": `count` maps
    one micro-batch's target to its items, on the last cell's process. "input": `count` maps
    one micro-batch of the input to its items (a model's labels), on cell 0's process, which
    tells the last cell's; None there when the input holds none (the step then weighs rows).
    `given`: the count the mean divides by (num_items_in_batch), instead of the whole batch's.
    `tell`: hands the model the count it divides its own loss by (num_items_in_batch), and
    None once the step is over; with it, a micro-batch's loss is already its share."""

    source: str
    count: CountFn | None
    given: int | None = None
    tell: Callable[[int | None], None] | None = None

    def __post_init__(self) -> None:
        assert self.source in ("target", "input"), self.source


@dataclass(frozen=True)
class StepItems:
    """The items of one step: per micro-batch of this replica's batch, and their total over
    every replica (or the count given instead)."""

    local: list[int]
    total: int


def count_items(count: CountFn, values: Sequence[Any]) -> list[int]:
    """The items of each micro-batch's `values` (one host synchronisation for tensors):
    ValueError for a count that is not a non-negative whole number."""
    counted = [count(value) for value in values]
    tensors = [c for c in counted if isinstance(c, Tensor)]
    if counted and len(tensors) == len(counted) and all(t.numel() == 1 for t in tensors):
        numbers: list[Any] = torch.stack([t.reshape(()) for t in tensors]).tolist()
    else:
        numbers = [c.item() if isinstance(c, Tensor) else c for c in counted]
    result = []
    for m, number in enumerate(numbers):
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise TypeError(
                f"the count of micro-batch {m}'s items must be an int or a 0-dim tensor, got "
                f"{type(number).__name__}"
            )
        if number < 0 or number != int(number):
            raise ValueError(
                f"the count of micro-batch {m}'s items must be a whole number >= 0, got {number}"
            )
        result.append(int(number))
    return result


def check_items_given(given: object) -> int | None:
    """num_items_in_batch as an int (None stays None): an int or a 0-dim integer tensor > 0."""
    if given is None:
        return None
    value: Any = given
    if isinstance(given, Tensor):
        if given.dim() != 0 or given.is_floating_point() or given.is_complex():
            raise ValueError(
                "num_items_in_batch must be an int or a 0-dim integer tensor, got a tensor "
                f"of shape {tuple(given.shape)} and dtype {given.dtype}"
            )
        value = int(given.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"num_items_in_batch must be an int or None, got {type(given).__name__}")
    if value <= 0:
        raise ValueError(f"num_items_in_batch must be > 0, got {value}")
    return value


def item_weights(items: StepItems, divided: bool) -> list[float]:
    """Each micro-batch's loss weight: its items' share of the total (a mean over its items),
    or 1 when its loss is already divided by the total (`divided`); 0 without items."""
    if divided:
        return [1.0 if n else 0.0 for n in items.local]
    return [n / items.total if n else 0.0 for n in items.local]


def step_items(local: list[int], counted: int, given: int | None) -> StepItems:
    """A step's items: this replica's per micro-batch, and the total the mean divides by:
    `counted` (the whole batch's, over every replica) or `given`, which must hold them."""
    if given is not None and given < counted:
        raise ValueError(
            f"num_items_in_batch is {given}, but this step's batch alone counts {counted} "
            "items: give the count over the whole batch (every replica, and every step whose "
            "gradients accumulate before the optimizer's step)"
        )
    return StepItems(local, counted if given is None else given)

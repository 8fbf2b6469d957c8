"""How a step's loss reduces its micro-batches, and the loss of an empty pipe."""

from __future__ import annotations

from typing import Any

import torch

from gpipe_fast.arguments import REDUCTIONS
from gpipe_fast.nn.items import Counting, ItemMean, check_items_given, count_items
from gpipe_fast.nn.microbatch import Value, as_tensors
from gpipe_fast.runtime.context import LossFn


def loss_reduction(reduction: object, num_items_in_batch: object) -> tuple[str, Counting | None]:
    """A step's reduction as the runtime takes it: "mean" or "sum", or how to count the
    items of an items mean (gf.ItemMean: in the target)."""
    given = check_items_given(num_items_in_batch)
    if isinstance(reduction, ItemMean):
        return "mean", Counting("target", reduction.counter(), given)
    if given is not None:
        raise ValueError(
            f"num_items_in_batch divides a mean over counted items, but reduction is "
            f"{reduction!r}: give reduction=gf.ItemMean()"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction must be one of {REDUCTIONS} or a gpipe_fast.ItemMean, got {reduction!r}"
        )
    return str(reduction), None


def identity_loss(
    input: Value | None, target: Any, loss_fn: LossFn, counting: Counting | None = None
) -> torch.Tensor:
    """The loss of an empty pipe: that of the input itself (an items mean divided by the
    count given instead of its own, with num_items_in_batch)."""
    as_tensors(input, "input")
    loss = loss_fn(input, target)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError("loss_fn must return a scalar (0-dim) tensor, the loss of its batch")
    if counting is not None and counting.given is not None and counting.count is not None:
        (items,) = count_items(counting.count, [target])
        loss = loss * (items / counting.given) if items else torch.zeros_like(loss)
    return loss


def identity_train_step(
    input: Value, target: Any, loss_fn: LossFn, counting: Counting | None = None
) -> torch.Tensor:
    """train_step of an empty pipe: the loss of the input, its gradient into the input."""
    loss = identity_loss(input, target, loss_fn, counting)
    if loss.requires_grad:
        loss.backward()
    return loss.detach()

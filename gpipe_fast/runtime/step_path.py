"""Around a step's run (Pipeline.run): its loss weights, its items, its input's gradient.

Every step but one runs as one whole schedule through `Pipeline.run` (runtime/pipeline.py):
train_step, eval_step, and pipe(x) without gradients across processes. pipe(x) with
gradients in one process is the other path (runtime/autograd_call.py): its backward is the
user's, through autograd.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from gpipe_fast.nn.items import item_weights
from gpipe_fast.nn.microbatch import BatchShare, loss_weights
from gpipe_fast.runtime.step import Step
from gpipe_fast.runtime.step_request import StepRequest


def check_items(request: StepRequest, share: BatchShare) -> None:
    """Refuses num_items_in_batch where the share found no labels to count."""
    counting = request.counting
    if counting is not None and counting.given is not None and share.items is None:
        raise ValueError(
            "num_items_in_batch: it divides a loss that averages over counted items, but "
            "the inputs hold no labels to count"
        )


def teller(request: StepRequest, share: BatchShare) -> Callable[[int | None], None] | None:
    """What tells a model that divides its own loss by the items (num_items_in_batch) their
    count; None where the step counts none or the model divides by nothing."""
    counting = request.counting
    return counting.tell if counting is not None and share.items is not None else None


def set_loss(step: Step, request: StepRequest, share: BatchShare) -> None:
    """The step's loss: each micro-batch weighed by its items' share of the batch's (a model
    told the count weighs its own), else by its rows' share (or added up, "sum")."""
    assert request.loss_fn is not None
    if share.items is not None:
        weights = item_weights(share.items, divided=teller(request, share) is not None)
    else:
        weights = loss_weights(share.batch, share.total, request.chunks, request.reduction)
    step.context.set_loss(request.loss_fn, share.targets, weights, request.loss_scale)


def without_items(local: Tensor | None, share: BatchShare) -> Tensor | None:
    """The mean over no item at all is undefined, as the plain model's 0/0 says (its
    gradients stay zero here too: no micro-batch weighs anything)."""
    if local is not None and share.items is not None and share.items.total == 0:
        return torch.full_like(local, float("nan"))
    return local


def accumulate_input_grads(
    given: Sequence[Tensor], needs: Sequence[bool], microbatch_grads: Sequence[Any]
) -> None:
    """Adds the input's gradient into the caller's tensors, as backward() would."""
    for position, (tensor, wanted) in enumerate(zip(given, needs, strict=True)):
        if not wanted:
            continue
        pieces = [grads[position] if grads is not None else None for grads in microbatch_grads]
        present = [p for p in pieces if p is not None]
        if len(present) < len(pieces):
            continue  # the input did not reach the loss: no gradient, as backward() leaves it
        grad = torch.cat([p.to(device=tensor.device, dtype=tensor.dtype) for p in present])
        torch.autograd.backward(tensor, grad)

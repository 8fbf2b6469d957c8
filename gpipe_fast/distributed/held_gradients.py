"""Gradients held before a step: kept out of its sums across ranks, then added back."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor


@contextmanager
def summing_this_step_only(tensors: Sequence[Tensor]) -> Iterator[None]:
    """Runs a step whose sums across ranks (data-parallel replicas, tied copies) see only
    this step's gradients of `tensors`, then adds back what each .grad held before it, as
    backward() accumulates: held + this step's.

    A gradient held from earlier steps (left to accumulate, no zero_grad in between) was
    already summed, so it is the same on every rank: summed again it would count once per
    rank. So each .grad is set to None for the step (its backward writes a fresh one) and
    the held tensor takes the step's sum once the step is done. A step that raises gets
    back the gradients it found, so none is left half summed.

    Cost: none held (zero_grad() sets them to None by default) is a pass over `tensors`;
    gradients zeroed in place (set_to_none=False) are held like any other: the step
    allocates fresh ones and each is added once into the held tensor."""
    held = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    try:
        yield
    except BaseException:
        for t, grad in zip(tensors, held, strict=True):
            t.grad = grad
        raise
    with torch.no_grad():
        for t, grad in zip(tensors, held, strict=True):
            if grad is None:
                continue
            if t.grad is not None:
                grad.add_(t.grad)  # into the held tensor, as the autograd engine accumulates
            t.grad = grad

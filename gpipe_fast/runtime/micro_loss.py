"""A micro-batch's loss as loss_fn returned it: checked to be a scalar, weighted by its share."""

from __future__ import annotations

import torch
from torch import Tensor


def scalar_loss(value: object) -> Tensor:
    """What loss_fn returned, which must be the scalar loss of its micro-batch."""
    if not isinstance(value, Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise TypeError(
            f"loss_fn must return a scalar (0-dim) tensor, the loss of its micro-batch; got {shape}"
        )
    return value


def weighted(loss: Tensor, weight: float) -> Tensor:
    """The loss times its weight; a weight of 0 (no counted item) gives 0, not 0 * NaN."""
    if weight == 0.0:
        return torch.zeros_like(loss)
    return loss * weight if weight != 1.0 else loss

"""BatchNorm whose running statistics are those of the whole mini-batch, not each micro-batch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from gpipe_fast.nn.checkpoint import is_recomputing


class DeferredBatchNorm(_BatchNorm):
    """Normalises each micro-batch by its own statistics (as BatchNorm on that micro-batch
    would) but accumulates them and updates the running statistics once per mini-batch,
    when the pipe calls `commit()` after the forward pass. Recomputation tracks nothing."""

    # The statistics accumulated since the last commit (None: nothing yet).
    _sum: Tensor | None = None
    _squares: Tensor | None = None
    _count: int = 0

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input, got {input.dim()}D")

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        self._check_input_dim(input)
        if not is_recomputing():
            self._accumulate(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _accumulate(self, input: Tensor) -> None:
        dims = [d for d in range(input.dim()) if d != 1]
        # At least float32 (half inputs), float64 kept: a float64 model's statistics exact.
        values = input.to(torch.promote_types(input.dtype, torch.float32))
        total = values.sum(dims)
        squares = (values * values).sum(dims)
        count = input.numel() // input.size(1)
        if self._sum is None or self._squares is None:
            self._sum, self._squares, self._count = total, squares, count
        else:
            self._sum = self._sum + total
            self._squares = self._squares + squares
            self._count += count

    @torch.no_grad()
    def commit(self) -> None:
        """Folds the accumulated mini-batch statistics into the running statistics."""
        if self._sum is None or self._squares is None:
            return
        count = self._count
        mean = self._sum / count
        variance = (self._squares / count - mean * mean).clamp_min(0)
        unbiased = variance * (count / max(count - 1, 1))
        assert self.num_batches_tracked is not None and self.running_mean is not None
        assert self.running_var is not None
        self.num_batches_tracked += 1
        if self.momentum is None:
            momentum = 1.0 / float(self.num_batches_tracked)
        else:
            momentum = self.momentum
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(
            unbiased.to(self.running_var.dtype), alpha=momentum
        )
        self._sum = self._squares = None
        self._count = 0

    def discard(self) -> None:
        """Forgets the statistics accumulated since the last commit (a failed step's)."""
        self._sum = self._squares = None
        self._count = 0

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Replaces BatchNorm layers in `module` (itself or nested) by DeferredBatchNorm
        sharing the same parameters and buffers, so state stays with the user's tensors."""
        if (
            isinstance(module, _BatchNorm)
            and not isinstance(module, cls)
            and module.track_running_stats
        ):
            deferred = cls(module.num_features, module.eps, module.momentum, module.affine, True)
            deferred.weight, deferred.bias = module.weight, module.bias
            deferred.running_mean = module.running_mean
            deferred.running_var = module.running_var
            deferred.num_batches_tracked = module.num_batches_tracked
            deferred.train(module.training)
            return deferred
        for name, child in module.named_children():
            converted = cls.convert(child)
            if converted is not child:
                setattr(module, name, converted)
        return module


def plain_batch_norms(module: nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers in `module` that track running statistics themselves."""
    return [
        m
        for m in module.modules()
        if isinstance(m, _BatchNorm)
        and not isinstance(m, DeferredBatchNorm)
        and m.track_running_stats
    ]


def batch_statistics_layers(module: nn.Module) -> list[str]:
    """The names of the BatchNorm layers in `module` that normalise by the batch's own
    statistics as they are now (in training mode, or tracking none): what they compute for a
    row depends on the other rows of its micro-batch."""
    return [
        name
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)
    ]


@contextmanager
def frozen_running_stats(layers: list[_BatchNorm]) -> Iterator[None]:
    """Keeps plain BatchNorm running statistics unchanged through a recompute, which must not
    count the same micro-batch twice. Momentum 0 leaves them as they are (they cannot be
    restored by copying: autograd saved them for backward), and the batch counter is put back.
    """
    training = [m for m in layers if m.training]
    saved = [
        (m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone())
        for m in training
    ]
    for m in training:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(training, saved, strict=True):
            m.momentum = momentum
            if tracked is not None and m.num_batches_tracked is not None:
                m.num_batches_tracked.copy_(tracked)

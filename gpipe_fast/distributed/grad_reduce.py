"""Gradients summed over processes: a stage's over data parallelism, in buckets; tied weights'."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gpipe_fast.distributed.guard import Guard

BUCKET_BYTES = 25 * 2**20  # as DistributedDataParallel's default


def buckets(params: Sequence[Tensor], limit: int) -> list[list[Tensor]]:
    """Tensors grouped by dtype and device, each group cut at `limit` bytes."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[Tensor]]] = {}
    for p in params:
        cut = groups.setdefault((p.dtype, p.device), [[]])
        size = sum(q.numel() * q.element_size() for q in cut[-1])
        if cut[-1] and size + p.numel() * p.element_size() > limit:
            cut.append([])
        cut[-1].append(p)
    return [bucket for cut in groups.values() for bucket in cut]


def sum_gradients(
    params: Sequence[Tensor], group: Any, guard: Guard, what: str, limit: int = BUCKET_BYTES
) -> None:
    """Replaces each parameter's gradient by its sum over `group` (a missing gradient counts
    as zeros, so every process reduces the same tensors): all buckets are posted at once,
    then waited for."""
    learning = [p for p in params if p.requires_grad]
    for p in learning:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    pending = []
    for bucket in buckets(learning, limit):
        flat = _flatten_dense_tensors([p.grad for p in bucket])
        pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for bucket, flat, request in pending:
        guard.wait(request, what, group=group)
        grads = [p.grad for p in bucket if p.grad is not None]
        for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(summed)

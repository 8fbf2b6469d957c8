"""Every copy of a weight starts equal: a tie's copies from one rank, replicas from another."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gpipe_fast.distributed.grad_reduce import BUCKET_BYTES, buckets
from gpipe_fast.distributed.guard import Guard
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.nn.tied import TiedGradients


def broadcast_ties(
    tied: TiedGradients, layout: ProcessLayout, guard: Guard, device: torch.device
) -> None:
    """Each tie's copies across the pipeline group take the values of the rank holding its
    first cell: ranks that built the model on the meta device initialised their copies
    apart (an embedding's init on one, a head's on another)."""
    for tie, (param, shape, dtype) in zip(tied.ties, tied.shared, strict=True):
        source = layout.global_rank(tie.places[0][0])
        buffer = (
            param.detach() if param is not None else torch.empty(shape, dtype=dtype, device=device)
        )
        request = dist.broadcast(buffer, source, group=layout.pp_group, async_op=True)
        guard.wait(request, "the tied parameters' initial values", source, layout.pp_group)


def broadcast_replicas(modules: Sequence[nn.Module], group: Any, guard: Guard) -> None:
    """Every parameter and buffer of `modules` takes the values of the first rank of the
    data-parallel `group`, as DistributedDataParallel does when it is built."""
    seen: set[int] = set()
    tensors: list[Tensor] = []
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor.detach())
    source = dist.get_global_rank(group, 0)
    for bucket in buckets(tensors, BUCKET_BYTES):
        flat = _flatten_dense_tensors(bucket)
        request = dist.broadcast(flat, source, group=group, async_op=True)
        guard.wait(request, "the replicas' initial weights", source, group)
        with torch.no_grad():
            for tensor, value in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                tensor.copy_(value)

"""Layers handed to the ranks that run them after a tuning re-cut a pipe across processes.

Every rank holds the whole model (the tuner checks it); a layer's values, running statistics
and gradients go from the rank that ran it to every other rank of the pipeline, so that the
rank that runs it now has them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def move_layers(module: nn.Module, before: Sequence[int], after: Sequence[int], group: Any) -> int:
    """Broadcasts each layer whose rank changes (`before[i]` to `after[i]`, global ranks)
    from the rank that held it, over `group`; every rank calls it. Returns how many moved."""
    moved = 0
    layers = list(module._modules.values())
    for layer, source, target in zip(layers, before, after, strict=True):
        if source == target or layer is None:
            continue
        moved += 1
        params = list(dict.fromkeys(layer.parameters()))
        with torch.no_grad():
            for tensor in [*params, *dict.fromkeys(layer.buffers())]:
                dist.broadcast(tensor.data, src=source, group=group)
            flags = [[p.grad is not None for p in params]]
            dist.broadcast_object_list(flags, src=source, group=group)
            for param, has_grad in zip(params, flags[0], strict=True):
                if not has_grad:
                    param.grad = None
                    continue
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.broadcast(param.grad, src=source, group=group)
    return moved


def layer_ranks(balance: Sequence[int], cell_ranks: Sequence[int]) -> list[int]:
    """The global rank of each layer, its cell's (`cell_ranks[k]`)."""
    return [rank for size, rank in zip(balance, cell_ranks, strict=True) for _ in range(size)]

"""Multi-process cases of a float32 model sharded over its data-parallel group on gloo."""

from __future__ import annotations

from typing import Any

import dist_cases
import sharded_cases
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf


def train_float32(rank: int, world: int, *, sync: str, size: int) -> dict[str, Any]:
    """One step of dist_cases' model in float32, one replica per rank, every stage sharded:
    the loss and the whole gradients."""
    pipe = gf.GPipe(dist_cases.model(2).float(), [4], chunks=2, dp_group=dist.group.WORLD,
                    dp_shard=True, dp_shard_sync=sync, timeout=60)  # fmt: skip
    x, y = dist_cases.batch(size, seed=100)
    try:
        xs, ys = dist_cases.shard(x, rank, world), dist_cases.shard(y, rank, world)
        loss = pipe.train_step(xs.float(), ys.float(), nn.functional.mse_loss)
        return {"loss": loss.item(), "grads": sharded_cases.full_grads(pipe)}
    finally:
        pipe.close()

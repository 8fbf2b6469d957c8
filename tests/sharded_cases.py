"""Multi-process cases of stages sharded over their data-parallel group (dp_shard)."""

from __future__ import annotations

from typing import Any

import dist_cases
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf


def full_grads(pipe: gf.GPipe) -> dict[str, list[Any]]:
    """Every gradient, whole (a shard's DTensor gathered), under the model's own keys."""
    grads = {}
    for name, param in pipe.named_parameters():
        if param.grad is not None:
            grad = param.grad
            grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).tolist()
    return grads


def train(
    rank: int,
    world: int,
    *,
    schedule: str,
    layers: int,
    balance: list[int],
    chunks: int,
    checkpoint: str,
    batches: list[int],
    pp: int,
    dp: int,
    sync: str = "per_microbatch",
    reshard_after_forward: bool = True,
    zero_grad: bool = True,
) -> dict[str, Any]:
    """Steps of `batches` sizes on a sharded pipe: per step the loss and the whole gradients,
    and whether every parameter is a shard."""
    pp_group, dp_group, replica = dist_cases.groups(pp, dp)
    net = dist_cases.model(layers)
    pipe = gf.GPipe(
        net, balance, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
        pp_group=pp_group, dp_group=dp_group, timeout=60, dp_shard=True,
        dp_shard_sync=sync, reshard_after_forward=reshard_after_forward,
    )  # fmt: skip
    steps = []
    try:
        for step, size in enumerate(batches):
            x, y = dist_cases.batch(size, seed=100 + step)
            if zero_grad:
                pipe.zero_grad(set_to_none=True)
            xs, ys = dist_cases.shard(x, replica, dp), dist_cases.shard(y, replica, dp)
            loss = pipe.train_step(xs, ys, nn.functional.mse_loss)
            steps.append({"loss": loss.item(), "grads": full_grads(pipe)})
        local = {
            name: (type(p).__name__, p.to_local().numel() if hasattr(p, "to_local") else p.numel())
            for name, p in pipe.named_parameters()
        }
    finally:
        pipe.close()
    return {"steps": steps, "local": local}


def collectives(
    rank: int,
    world: int,
    *,
    schedule: str,
    chunks: int,
    checkpoint: str,
    sync: str,
    reshard_after_forward: bool,
    pp: int,
    dp: int,
) -> dict[str, int]:
    """The all-gathers and reduce-scatters this rank's sharded cells make in a second step
    (torch.distributed's calls counted), and how many FSDP units of layers it holds."""
    pp_group, dp_group, replica = dist_cases.groups(pp, dp)
    cells = 2 * pp if schedule in ("interleaved", "zbv") else pp
    layers = 2 * cells
    pipe = gf.GPipe(
        dist_cases.model(layers), [2 * 2] * cells, chunks=chunks, checkpoint=checkpoint,
        schedule=schedule, pp_group=pp_group, dp_group=dp_group, timeout=60, dp_shard=True,
        dp_shard_sync=sync, reshard_after_forward=reshard_after_forward,
    )  # fmt: skip
    counts = {"all_gather": 0, "reduce_scatter": 0}
    originals = {name: getattr(dist, f"{name}_single") for name in counts}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    try:
        for step in range(2):
            x, y = dist_cases.batch(4 * chunks, seed=100 + step)
            if step == 1:
                for name in counts:
                    setattr(dist, f"{name}_single", counting(name))
            pipe.train_step(dist_cases.shard(x, replica, dp), dist_cases.shard(y, replica, dp),
                            nn.functional.mse_loss)  # fmt: skip
    finally:
        for name, original in originals.items():
            setattr(dist, f"{name}_single", original)
        pipe.close()
    units = sum(
        1 for cell in pipe.partitions for layer in cell.children() if list(layer.parameters())
    )
    return {**counts, "units": units, "first_stage": pipe.layout.is_local(0)}

"""Multi-process cases of stages sharded over their data-parallel group (dp_shard)."""

from __future__ import annotations

from typing import Any

import dcp_cases
import dist_cases
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

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


def optimize(
    rank: int,
    world: int,
    *,
    schedule: str,
    pp: int,
    dp: int,
    sizes: list[int],
    max_norm: float,
    scaler: bool,
) -> dict[str, Any]:
    """AdamW steps on a sharded pipe, each clipped by pipe.clip_grad_norm_ (through a
    gf.GradScaler when `scaler`), then an eval_step: per step the norm; the parameters whole
    after the steps; the evaluation's loss; the optimizer state's local sizes."""
    pp_group, dp_group, replica = dist_cases.groups(pp, dp)
    cells = 2 * pp if schedule in ("interleaved", "zbv") else max(pp, 2)
    pipe = gf.GPipe(
        dist_cases.model(4), [8 // cells] * cells, chunks=3, checkpoint="except_last",
        schedule=schedule, pp_group=pp_group, dp_group=dp_group, timeout=60, dp_shard=True,
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.1)
    grad_scaler = gf.GradScaler(pipe, init_scale=1024.0) if scaler else None
    norms = []
    try:
        for step, size in enumerate(sizes):
            x, y = dist_cases.batch(size, seed=100 + step)
            xs, ys = dist_cases.shard(x, replica, dp), dist_cases.shard(y, replica, dp)
            opt.zero_grad(set_to_none=True)
            pipe.train_step(xs, ys, nn.functional.mse_loss, grad_scaler=grad_scaler)
            if grad_scaler is not None:
                grad_scaler.unscale_(opt)
            norms.append(pipe.clip_grad_norm_(max_norm).item())
            if grad_scaler is not None:
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                opt.step()
        x, y = dist_cases.batch(9, seed=7)
        xs, ys = dist_cases.shard(x, replica, dp), dist_cases.shard(y, replica, dp)
        evaluated = pipe.eval_step(xs, ys, nn.functional.mse_loss).item()
        gathered_after_eval = [
            name for name, p in pipe.named_parameters() if type(p).__name__ != "DTensor"
        ]
        params = {name: p.full_tensor().tolist() for name, p in pipe.named_parameters()}
        state = {
            name: opt.state[p]["exp_avg"].to_local().numel() for name, p in pipe.named_parameters()
        }
    finally:
        pipe.close()
    return {"norms": norms, "params": params, "eval": evaluated, "state": state,
            "gathered_after_eval": gathered_after_eval}  # fmt: skip


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole_snapshot(module: nn.Module, opt: torch.optim.Optimizer) -> dcp_cases.Snapshot:
    """dcp_cases.snapshot with every shard gathered whole."""
    group_of = {id(p): group for group in opt.param_groups for p in group["params"]}
    taken = {}
    for name, param in module.named_parameters():
        state, group = opt.state[param], group_of[id(param)]
        taken[name] = {
            "param": whole(param).tolist(),
            "exp_avg": whole(state["exp_avg"]).tolist(),
            "exp_avg_sq": whole(state["exp_avg_sq"]).tolist(),
            "step": float(whole(state["step"])),
            "settings": [group["lr"], list(group["betas"]), group["weight_decay"]],
        }
    return taken


def _checkpoint_pipe(pp: int, dp: int, shard: bool, seed: int) -> tuple[gf.GPipe, int]:
    pp_group, dp_group, replica = dist_cases.groups(pp, dp)
    balance = [4, 4] if pp == 2 else [3, 5]
    pipe = gf.GPipe(dist_cases.model(4, seed=seed), balance, chunks=2, schedule="1f1b",
                    pp_group=pp_group, dp_group=dp_group, timeout=60, dp_shard=shard)  # fmt: skip
    return pipe, replica


def _replica_step(replica: int, dp: int) -> dcp_cases.Step:
    def step(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        xs, ys = dist_cases.shard(x, replica, dp), dist_cases.shard(y, replica, dp)
        dcp_cases.pipe_step(module, xs, ys)

    return step


def dcp_saved(rank: int, world: int, *, path: str, flat: bool, pp: int, shard: bool) -> list[str]:
    """dcp_cases.SAVED_AFTER steps (AdamW in two groups), then a DCP checkpoint; its keys."""
    dp = world // pp
    pipe, replica = _checkpoint_pipe(pp, dp, shard, seed=0)
    try:
        opt = dcp_cases.optimizer(pipe)
        dcp_cases.train(pipe, opt, _replica_step(replica, dp), range(dcp_cases.SAVED_AFTER))
        dcp_cases.save(pipe, opt, path, flat)
        return sorted(pipe.state_dict())
    finally:
        pipe.close()


def dcp_resumed(
    rank: int, world: int, *, path: str, flat: bool, pp: int, shard: bool
) -> dcp_cases.Snapshot:
    """Another initialisation, the checkpoint loaded, one step: the whole tensors."""
    dp = world // pp
    pipe, replica = _checkpoint_pipe(pp, dp, shard, seed=99)
    try:
        opt = dcp_cases.optimizer(pipe)
        dcp_cases.load(pipe, opt, path, flat)
        after = dcp_cases.SAVED_AFTER
        dcp_cases.train(pipe, opt, _replica_step(replica, dp), range(after, after + 1))
        return whole_snapshot(pipe, opt)
    finally:
        pipe.close()

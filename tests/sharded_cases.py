"""Multi-process cases of stages sharded over their data-parallel group (dp_shard)."""

from __future__ import annotations

from typing import Any

import dcp_cases
import dist_cases
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import gpipe_fast as gf

from helpers import whole


def train(
    rank: int,
    world: int,
    *,
    sync: str = "per_microbatch",
    reshard_after_forward: bool = True,
    **kwargs: Any,
) -> dict[str, Any]:
    """dist_cases.train on a sharded pipe: per step the loss and the whole gradients, and
    each parameter's type and local size (a shard's)."""
    return dist_cases.train(rank, world, dp_shard=True, dp_shard_sync=sync,
                            reshard_after_forward=reshard_after_forward, **kwargs)  # fmt: skip


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


def uneven_replicas(rank: int, world: int) -> tuple[str, str]:
    """Replica 0 gets 2 rows, replica 1 four, with chunks=3: every rank's error."""
    pipe = gf.GPipe(dist_cases.model(2), [2, 2], chunks=3, dp_group=dist.group.WORLD,
                    dp_shard=True, timeout=60)  # fmt: skip
    x, y = dist_cases.batch(2 + 2 * rank, seed=1)
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except ValueError as error:
        return type(error).__name__, str(error)
    finally:
        pipe.close()
    return "", ""


def bad_arguments(rank: int, world: int) -> list[str]:
    """The errors of sharding arguments that do not fit."""
    messages = []
    for kwargs in (
        {"dp_shard": True},
        {"dp_shard": True, "dp_group": dist.group.WORLD, "dp_shard_sync": "per_token"},
        {"dp_shard": 1, "dp_group": dist.group.WORLD},
        {"dp_shard": True, "dp_group": init_device_mesh("cpu", (world,))},  # 1-D: accepted
    ):
        try:
            pipe = gf.GPipe(dist_cases.model(2), [2, 2], chunks=2, timeout=60, **kwargs)
        except (TypeError, ValueError) as error:
            messages.append(str(error))
        else:
            pipe.close()
            messages.append("built")
    try:
        gf.GPipe(dist_cases.model(3, ties=((0, 4),)), [2, 4], dp_group=dist.group.WORLD,
                 dp_shard=True, timeout=60)  # fmt: skip
    except ValueError as error:
        messages.append(str(error))
    return messages


def failing_replica(rank: int, world: int, *, timeout: float) -> tuple[str, float]:
    """Replica 1's loss_fn raises in the second step: every rank's error type, and how long
    its step took to end."""
    import time

    pipe = gf.GPipe(dist_cases.model(2), [2, 2], chunks=2, dp_group=dist.group.WORLD,
                    dp_shard=True, timeout=timeout)  # fmt: skip

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if rank == 1 and failing:
            raise RuntimeError("planted")
        return nn.functional.mse_loss(output, target)

    x, y = dist_cases.batch(4, seed=1)
    failing = False
    pipe.train_step(x, y, loss_fn)
    failing = True
    start = time.monotonic()
    try:
        pipe.train_step(x, y, loss_fn)
    except Exception as error:
        return type(error).__name__, time.monotonic() - start
    finally:
        pipe.close()
    return "", time.monotonic() - start


def order_checks(rank: int, world: int) -> list[str]:
    """A step, then replica 1 records one task more than replica 0: the order check's error;
    and a task entered while another of the cell runs: its error."""
    pipe = gf.GPipe(dist_cases.model(2), [2, 2], chunks=2, dp_group=dist.group.WORLD,
                    dp_shard=True, timeout=30)  # fmt: skip
    messages = []
    try:
        x, y = dist_cases.batch(4, seed=1)
        pipe.train_step(x, y, nn.functional.mse_loss)
        sharding = pipe._pipeline.sharding  # type: ignore[union-attr]
        cell = sharding.cells[0]
        if rank == 1:
            with cell.task("forward", 7):
                pass
        try:
            sharding.check_order()
        except RuntimeError as error:
            messages.append(str(error))
        with cell.task("forward", 0):
            try:
                with cell.task("backward", 0):
                    pass
            except RuntimeError as error:
                messages.append(str(error))
    finally:
        pipe.close()
    return messages


def groups_made(rank: int, world: int) -> list[int]:
    """The process groups this process has, after each of three sharded pipes (of two cells
    each) built, stepped and closed one after the other."""
    from torch.distributed import distributed_c10d as c10d

    counts = []
    for _ in range(3):
        pipe = gf.GPipe(dist_cases.model(2), [2, 2], chunks=2, dp_group=dist.group.WORLD,
                        dp_shard=True, timeout=30)  # fmt: skip
        x, y = dist_cases.batch(4, seed=1)
        pipe.train_step(x, y, nn.functional.mse_loss)
        pipe.close()
        counts.append(len(c10d._world.pg_map))
    return counts

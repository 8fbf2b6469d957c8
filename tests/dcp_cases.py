"""DCP checkpoints of a pipe with AdamW in two param groups, with and without the flatten option:
each rank's part of tests/test_dcp_resume.py, and the plain model's run they must equal."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import dist_cases
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import gpipe_fast as gf

SAVED_AFTER = 2  # steps before the checkpoint; a resumed run takes the next one
Step = Callable[[nn.Module, torch.Tensor, torch.Tensor], None]
Snapshot = dict[str, dict[str, Any]]


def options(flat: bool) -> StateDictOptions | None:
    """The guide's default (None) or the flatten option."""
    return StateDictOptions(flatten_optimizer_state_dict=True) if flat else None


def model(seed: int) -> nn.Sequential:
    """Four Linear+Tanh in float64, the first Linear's weight tied to the third's."""
    return dist_cases.model(4, seed=seed, ties=dist_cases.CHECKPOINT_TIES)


def optimizer(module: nn.Module, lr_of_rank: float = 0.0) -> torch.optim.AdamW:
    """AdamW with the weights and the biases in two groups of their own lr, betas and weight
    decay (`lr_of_rank` added to the weights' lr: groups that differ between ranks)."""
    named = list(module.named_parameters())
    weights = [p for name, p in named if not name.endswith("bias")]
    biases = [p for name, p in named if name.endswith("bias")]
    return torch.optim.AdamW(
        [
            {"params": weights, "lr": 0.01 + lr_of_rank, "betas": (0.9, 0.99)},
            {"params": biases, "lr": 0.03, "betas": (0.8, 0.95), "weight_decay": 0.0},
        ],
        weight_decay=0.02,
    )


def pipe_step(pipe: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    pipe.train_step(x, y, nn.functional.mse_loss)  # type: ignore[operator]


def plain_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.mse_loss(net(x), y).backward()


def train(module: nn.Module, opt: torch.optim.Optimizer, step: Step, steps: range) -> None:
    for i in steps:
        x, y = dist_cases.batch(8, seed=300 + i)
        opt.zero_grad()
        step(module, x, y)
        opt.step()


def snapshot(module: nn.Module, opt: torch.optim.Optimizer) -> Snapshot:
    """Every parameter under each of its names: its value, its AdamW state and its group's
    settings, as plain data."""
    group_of = {id(p): group for group in opt.param_groups for p in group["params"]}
    taken = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        state, group = opt.state[param], group_of[id(param)]
        taken[name] = {
            "param": param.tolist(),
            "exp_avg": state["exp_avg"].tolist(),
            "exp_avg_sq": state["exp_avg_sq"].tolist(),
            "step": float(state["step"]),
            "settings": [group["lr"], list(group["betas"]), group["weight_decay"]],
        }
    return taken


def save(module: nn.Module, opt: torch.optim.Optimizer, path: str, flat: bool) -> None:
    model_state, optim_state = get_state_dict(module, opt, options=options(flat))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def load(module: nn.Module, opt: torch.optim.Optimizer, path: str, flat: bool) -> None:
    model_state, optim_state = get_state_dict(module, opt, options=options(flat))
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # in one process DCP says it loads alone
        dcp.load(state, checkpoint_id=path)
    set_state_dict(module, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options(flat))  # fmt: skip


def resumed_in_one_process(path: str, flat: bool, pipe: bool) -> Snapshot:
    """Another initialisation, the checkpoint loaded, one step: the plain model or a pipe of
    one process."""
    net = model(seed=99)
    module: nn.Module = gf.GPipe(net, [3, 5], devices=["cpu"] * 2, chunks=2) if pipe else net
    try:
        opt = optimizer(module)
        load(module, opt, path, flat)
        train(module, opt, pipe_step if pipe else plain_step, range(SAVED_AFTER, SAVED_AFTER + 1))
        return snapshot(module, opt)
    finally:
        if isinstance(module, gf.GPipe):
            module.close()


def _pipe(pp: int, dp: int, balance: list[int], seed: int) -> tuple[gf.GPipe, int]:
    """The pipe over the world's pp x dp mesh, and this rank's replica."""
    pp_group, dp_group, replica = dist_cases.groups(pp, dp)
    return gf.GPipe(model(seed), balance, chunks=2, schedule="1f1b", pp_group=pp_group,
                    dp_group=dp_group, timeout=60), replica  # fmt: skip


def saved_by_pp2(rank: int, world: int, *, path: str, flat: bool, balance: list[int]) -> None:
    """SAVED_AFTER steps at pp=2, then the checkpoint."""
    pipe, _ = _pipe(2, 1, balance, seed=0)
    try:
        opt = optimizer(pipe)
        train(pipe, opt, pipe_step, range(SAVED_AFTER))
        save(pipe, opt, path, flat)
    finally:
        pipe.close()


def resumed(
    rank: int, world: int, *, path: str, flat: bool, pp: int, balance: list[int]
) -> Snapshot:
    """Another initialisation, the checkpoint loaded at pp=`pp` (the other ranks data
    parallel), one step (each replica its share of the batch: the same gradients)."""
    replicas = world // pp
    pipe, replica = _pipe(pp, replicas, balance, seed=99)
    try:
        opt = optimizer(pipe)
        load(pipe, opt, path, flat)

        def step(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
            pipe_step(module, dist_cases.shard(x, replica, replicas),
                      dist_cases.shard(y, replica, replicas))  # fmt: skip

        train(pipe, opt, step, range(SAVED_AFTER, SAVED_AFTER + 1))
        return snapshot(pipe, opt)
    finally:
        pipe.close()


def groups_differ(rank: int, world: int, *, flat: bool) -> list[str]:
    """The weights' lr differs between the ranks: get_state_dict's optimizer state dict."""
    pipe, _ = _pipe(2, 1, [4, 4], seed=0)
    try:
        opt = optimizer(pipe, lr_of_rank=0.001 * rank)
        train(pipe, opt, pipe_step, range(1))
        _, optim_state = get_state_dict(pipe, opt, options=options(flat))
        return sorted(optim_state)
    finally:
        pipe.close()


def load_without(rank: int, world: int, *, left_out: str) -> None:
    """A nested optimizer state dict whose param_groups leave `left_out` out, set on each rank."""
    pipe, _ = _pipe(2, 1, [4, 4], seed=0)
    try:
        opt = optimizer(pipe)
        train(pipe, opt, pipe_step, range(1))
        model_state, optim_state = get_state_dict(pipe, opt)
        groups: Any = optim_state["param_groups"]
        for group in groups:
            group["params"] = [n for n in group["params"] if n != left_out]
        set_state_dict(pipe, opt, model_state_dict=model_state, optim_state_dict=optim_state)
    finally:
        pipe.close()


def uninterrupted() -> Snapshot:
    """The plain model after SAVED_AFTER + 1 steps."""
    net = model(seed=0)
    opt = optimizer(net)
    train(net, opt, plain_step, range(SAVED_AFTER + 1))
    return snapshot(net, opt)


def assert_resumed(ranks: list[Snapshot], uninterrupted: Snapshot) -> None:
    """Every parameter, under each of its names, on whichever ranks hold it: value, AdamW
    moments and step, and its group's lr, betas and weight decay, as never interrupted."""
    seen = set()
    for by_name in ranks:
        for name, taken in by_name.items():
            expected = uninterrupted[name]
            assert taken["settings"] == expected["settings"], name
            assert taken["step"] == expected["step"], name
            for key in ("param", "exp_avg", "exp_avg_sq"):
                actual, wanted = torch.tensor(taken[key]), torch.tensor(expected[key])
                try:
                    torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-15)
                except AssertionError as error:
                    raise AssertionError(f"{name} {key}: {error}") from None
            seen.add(name)
    assert seen == set(uninterrupted)

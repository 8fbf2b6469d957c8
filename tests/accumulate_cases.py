"""Cases for the cluster's workers: gradients left to accumulate over several train_steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from dist_cases import cross_entropy, groups, shard, tied_model, tokens
from torch import nn

import gpipe_fast as gf
from gpipe_fast.schedule.registry import schedule_kind

# Each step's batch size (step i draws tokens(BATCHES[i], seed=100 + i)): uneven shares.
BATCHES = (12, 7, 9, 10, 8)


def gradients(module: nn.Module) -> dict[str, list[Any]]:
    """The module's gradients under its state dict's keys (a tie under each of its names)."""
    return {
        name: tensor.grad.tolist()
        for name, tensor in module.state_dict(keep_vars=True).items()
        if tensor.grad is not None
    }


def tied_balance(schedule: str) -> list[int]:
    """The tied model (embedding, Linear, Tanh, head tied to the embedding) cut so that the
    embedding is in the first cell and the head in the last: two cells, or four where the
    kind runs several per rank (interleaved puts them on two ranks, zbv's V on one)."""
    return [1, 3] if schedule_kind(schedule).stages_per_worker == 1 else [1, 1, 1, 1]


def accumulation(
    module: nn.Module,
    train: Callable[[int], object],
    clip: Callable[[float], torch.Tensor],
    *,
    accumulated: int,
    restarted: int,
    max_norm: float,
) -> dict[str, Any]:
    """From gradients set to None, `accumulated` steps (`train(i)` runs step i) with no
    zero_grad between them, and the gradients after each; then `clip(max_norm)` (its norm
    and the clipped gradients); then, from gradients zeroed in place, `restarted` steps.
    Gradients under the model's own keys, as lists (they travel back from the workers)."""
    module.zero_grad(set_to_none=True)
    from_none = []
    for i in range(accumulated):
        train(i)
        from_none.append(gradients(module))
    norm = clip(max_norm).item()
    clipped = gradients(module)
    module.zero_grad(set_to_none=False)
    from_zeros = []
    for i in range(accumulated, accumulated + restarted):
        train(i)
        from_zeros.append(gradients(module))
    return {"from_none": from_none, "norm": norm, "clipped": clipped, "from_zeros": from_zeros}


def accumulate(
    rank: int, world: int, *, schedule: str, pp: int, dp: int, **steps: Any
) -> dict[str, Any]:
    """accumulation() of the tied model's pipe with `pp` x `dp` processes."""
    pp_group, dp_group, replica = groups(pp, dp)
    pipe = gf.GPipe(
        tied_model(), tied_balance(schedule), chunks=3, schedule=schedule,
        devices=["cpu"] * 2 if pp_group is None else None,  # two workers in one process
        pp_group=pp_group, dp_group=dp_group, timeout=60,
    )  # fmt: skip

    def train(i: int) -> None:
        x, y = tokens(BATCHES[i], seed=100 + i)
        pipe.train_step(shard(x, replica, dp), shard(y, replica, dp), cross_entropy)

    try:
        return accumulation(pipe, train, pipe.clip_grad_norm_, **steps)
    finally:
        pipe.close()


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("planted in a backward")


class FailsInBackward(nn.Module):
    """The identity, whose backward raises while `armed`."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RaiseInBackward.apply(x) if self.armed else x  # type: ignore[no-any-return]


def failed_accumulation(rank: int, world: int) -> dict[str, Any]:
    """dp_group alone: one step, then a second one (gradients left to accumulate) whose
    backward raises on rank 0 in cell 0, after cell 1's gradients were summed. Each rank's
    gradients after the first step and after the failed one, and the failure's type."""
    _, dp_group, replica = groups(1, world)
    torch.manual_seed(0)
    fails = FailsInBackward()
    net = nn.Sequential(nn.Linear(5, 5), fails, nn.Tanh(), nn.Linear(5, 5)).double()
    pipe = gf.GPipe(net, [2, 2], chunks=2, checkpoint="never", dp_group=dp_group, timeout=20)
    generator = torch.Generator().manual_seed(7)
    x, y = (torch.randn(8, 5, generator=generator, dtype=torch.float64) for _ in range(2))
    x, y = shard(x, replica, world), shard(y, replica, world)
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
        before = gradients(pipe)
        fails.armed = rank == 0
        try:
            pipe.train_step(x, y, nn.functional.mse_loss)
            error = None
        except Exception as failure:
            error = type(failure).__name__
    finally:
        pipe.close()
    return {"before": before, "after": gradients(pipe), "error": error}

"""Cases of test_dist_transport.py, run on both ranks of a Cluster: one model trained over
shared memory and over gloo, every checkpoint mode, results kept bit for bit."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast.distributed.shm_links import ENV, POISON_ENV
from gpipe_fast.skip import pop, skippable, stash

WIDTH = 6
CHECKPOINTS = ("always", "except_last", "never")
TRANSPORTS = {"shared memory": "", "gloo": "gloo"}  # GPIPE_FAST_TRANSPORT's value for each


class ColumnLinear(nn.Module):
    """A linear layer computed on the transposed batch: its output and its input's gradient
    are transposed views (not contiguous), as many real layers' are."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.bias = nn.Parameter(torch.randn(WIDTH, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight @ x.t() + self.bias).t()


@skippable(stash=["kept"])
class StashTanh(nn.Module):
    """Stashes its output (a transposed view) for PopMix, several cells on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = ColumnLinear()

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        y = torch.tanh(self.lin(x))
        yield stash("kept", y)
        return y


@skippable(pop=["kept"])
class PopMix(nn.Module):
    """Mixes the popped skip in through a layer of its own: the skip's gradient is a
    transposed view too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = ColumnLinear()

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        kept = yield pop("kept")
        return x + self.lin(kept)


def strided_model(seed: int) -> nn.Sequential:
    """Eight float64 layers whose every output and input gradient is a non-contiguous view,
    with a skip from layer 1 to layer 6 (across ranks in [4, 4] and in [2, 2, 2, 2])."""
    torch.manual_seed(seed)
    layers = [ColumnLinear(), StashTanh(), ColumnLinear(), nn.Tanh(), ColumnLinear(),
              nn.Tanh(), PopMix(), ColumnLinear()]  # fmt: skip
    return nn.Sequential(*layers).double()


def batch(size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    x = torch.randn(size, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(size, WIDTH, generator=g, dtype=torch.float64)


def over_both_transports(
    make: Callable[[str], gf.GPipe], run: Callable[[gf.GPipe], Any]
) -> dict[str, Any]:
    """Per checkpoint mode and transport (keyed "<checkpoint> <transport>"), what `run`
    returns for the pipe `make(checkpoint)` builds with GPIPE_FAST_TRANSPORT set for that
    transport (closed after); and whether the rings ran poisoned."""
    runs: dict[str, Any] = {}
    saved = os.environ.get(ENV)
    try:
        for checkpoint in CHECKPOINTS:
            for name, value in TRANSPORTS.items():
                os.environ[ENV] = value
                pipe = make(checkpoint)
                try:
                    assert pipe.transport_kind == name, pipe.transport_reason
                    runs[f"{checkpoint} {name}"] = run(pipe)
                finally:
                    pipe.close()
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved
    return {"runs": runs, "poisoned": os.environ.get(POISON_ENV) == "1"}


def both_transports(
    rank: int, world: int, *, schedule: str, balance: list[int], batches: list[int], seed: int
) -> dict[str, Any]:
    """Per checkpoint mode and transport, each step's loss and this rank's gradients (as
    lists: compared bit for bit), then the parameters after an SGD step each."""
    import torch.distributed as dist

    def make(checkpoint: str) -> gf.GPipe:
        return gf.GPipe(strided_model(seed), balance, chunks=3, schedule=schedule,
                        checkpoint=checkpoint, pp_group=dist.group.WORLD, timeout=60)  # fmt: skip

    def run(pipe: gf.GPipe) -> dict[str, Any]:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        steps = []
        for step, size in enumerate(batches):
            x, y = batch(size, step)
            optimizer.zero_grad(set_to_none=True)
            loss = pipe.train_step(x, y, nn.functional.mse_loss)
            grads = {n: p.grad.tolist() for n, p in pipe.named_parameters() if p.grad is not None}
            optimizer.step()
            steps.append({"loss": loss.item(), "grads": grads})
        return {"steps": steps, "params": {n: p.tolist() for n, p in pipe.named_parameters()}}

    return over_both_transports(make, run)

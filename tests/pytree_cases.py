"""A model whose layers pass pytrees (a dict holding a bool mask, ints and a string; a tuple
holding None, an int and a tensor with no batch dim; a namedtuple holding a float, an int64
tensor, a bool and that tensor again), and the cases of test_pytree.py run on both ranks of
a Cluster."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import torch
from torch import nn
from transport_cases import over_both_transports

import gpipe_fast as gf

WIDTH = 6

Pair = namedtuple("Pair", ["h", "scale", "pos", "on", "cos"])


def _dict(h: torch.Tensor) -> dict[str, Any]:
    # "rows" differs between uneven micro-batches: a value that travels with its own one.
    return {"h": h, "mask": h > 0, "n": 3, "rows": h.size(0), "tag": "dict"}


class FromTensor(nn.Module):
    """Tensor -> dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return _dict(torch.tanh(self.lin(x)))


class DictToTuple(nn.Module):
    """dict -> (h, None, cos, 2): cos has no batch dim and needs a gradient (of `freq`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.freq = nn.Parameter(torch.randn(WIDTH))

    def forward(self, d: dict[str, Any]) -> tuple[Any, ...]:
        assert type(d) is dict and d["tag"] == "dict" and d["n"] == 3, d
        assert d["rows"] == d["h"].size(0) and d["mask"].dtype == torch.bool
        h = torch.tanh(self.lin(d["h"])) * d["n"] + 0.25 * d["mask"]
        return (h, None, torch.cos(self.freq), 2)


class TupleToPair(nn.Module):
    """(h, None, cos, 2) -> Pair(h, 0.5, pos, True, cos): pos an int64 tensor per sample,
    cos passed on as it came (a layer's input leaf that is also its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, t: tuple[Any, ...]) -> Pair:
        assert type(t) is tuple and len(t) == 4 and t[1] is None and t[3] == 2, t
        h, _, cos, k = t
        h = torch.tanh(self.lin(h * cos)) * k
        return Pair(h, 0.5, (h > 0).sum(dim=1), True, cos)


class PairToDict(nn.Module):
    """Pair -> dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, p: Pair) -> dict[str, Any]:
        assert isinstance(p, Pair) and p.on is True and p.pos.dtype == torch.int64, p
        shift = p.scale * p.pos[:, None].to(p.h.dtype)
        return _dict(torch.tanh(self.lin(p.h * p.cos) + shift))


class DictToOut(nn.Module):
    """dict -> {"y": ..., "k": 2, "mask": ...}: the output handed to loss_fn."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, d: dict[str, Any]) -> dict[str, Any]:
        return {"y": self.lin(d["h"]), "k": 2, "mask": d["mask"]}


def model(seed: int) -> nn.Sequential:
    """Eight float64 layers; cut [2, 2, 2, 2] passes a tuple with None, a dict and a Pair
    between cells, [4, 4] a dict, [3, 5] a Pair, [2, 6] the tuple."""
    torch.manual_seed(seed)
    layers = [FromTensor(), DictToTuple(), TupleToPair(), PairToDict(), DictToTuple(),
              TupleToPair(), PairToDict(), DictToOut()]  # fmt: skip
    return nn.Sequential(*layers).double()


def loss_fn(out: dict[str, Any], target: torch.Tensor) -> torch.Tensor:
    """Uses every leaf of the output; a mean over the micro-batch."""
    y = out["y"]
    return out["k"] * nn.functional.mse_loss(y, target) + (y * out["mask"]).square().mean()


def batch(size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randn(size, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(size, WIDTH, generator=g, dtype=torch.float64)


def both_transports(
    rank: int, world: int, *, schedule: str, balance: list[int], batches: list[int], seed: int
) -> dict[str, Any]:
    """Per checkpoint mode and transport: each training step's loss and this rank's
    gradients (as lists, compared bit for bit), the input's gradient on rank 0, then an
    eval_step's loss and pipe(x)'s output under no_grad (on the last rank); and whether the
    rings ran poisoned."""
    import torch.distributed as dist

    def make(checkpoint: str) -> gf.GPipe:
        return gf.GPipe(model(seed), balance, chunks=3, schedule=schedule, checkpoint=checkpoint,
                        pp_group=dist.group.WORLD, timeout=60)  # fmt: skip

    return over_both_transports(make, lambda pipe: _run(pipe, batches))


def _run(pipe: gf.GPipe, batches: list[int]) -> dict[str, Any]:
    steps = []
    for step, size in enumerate(batches):
        x, y = batch(size, step)
        x.requires_grad_()
        pipe.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, loss_fn)
        grads = {n: p.grad.tolist() for n, p in pipe.named_parameters() if p.grad is not None}
        x_grad = None if x.grad is None else x.grad.tolist()
        steps.append({"loss": loss.item(), "grads": grads, "x_grad": x_grad})
    x, y = batch(batches[0], 0)
    evaluated = pipe.eval_step(x, y, loss_fn).item()
    with torch.no_grad():
        out = pipe(x)
    output = None if out is None else {"y": out["y"].tolist(), "k": out["k"],
                                       "mask": out["mask"].tolist()}  # fmt: skip
    return {"steps": steps, "eval": evaluated, "output": output}

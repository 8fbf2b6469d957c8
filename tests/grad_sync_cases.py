"""Multi-process cases of test_grad_reduce.py and test_sync_copies.py: gradients summed over
processes in buckets, and copies of a weight made equal across them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpipe_fast.distributed.grad_reduce import sum_gradients
from gpipe_fast.distributed.guard import Guard
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.distributed.sync_copies import broadcast_replicas, broadcast_ties
from gpipe_fast.nn.tied import TiedGradients, find_ties

TIMEOUT_S = 60.0


def _guard(name: str) -> Guard:
    """Bounded waits (a failure here is this rank's own: a store of this process suffices)."""
    return Guard(dist.HashStore(), name, dist.get_rank(), TIMEOUT_S)


def _listed(tensors: list[torch.Tensor | None]) -> list[Any]:
    return [None if t is None else t.tolist() for t in tensors]


def summed_gradients(rank: int, world: int, *, limit: int) -> dict[str, Any]:
    """Parameters of two dtypes with random gradients (rank 1's first has none; the last
    learns nothing), summed over the world in buckets of `limit` bytes: the gradients before
    and after."""
    generator = torch.Generator().manual_seed(10 + rank)
    shapes = [((3, 4), torch.float64), ((5,), torch.float32), ((2, 2), torch.float64)]
    params = [nn.Parameter(torch.randn(*s, dtype=d, generator=generator)) for s, d in shapes]
    params.append(nn.Parameter(torch.randn(2, generator=generator), requires_grad=False))
    for p in params[:3]:
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=generator)
    if rank == 1:
        params[0].grad = None
    before = _listed([p.grad for p in params])
    guard = _guard(f"summed-{limit}")
    try:
        sum_gradients(params, dist.group.WORLD, guard, "the test's gradients", limit)
    finally:
        guard.close()
    return {"before": before, "after": _listed([p.grad for p in params])}


def replicas(rank: int, world: int) -> dict[str, Any]:
    """Modules whose parameters and buffers differ on each rank (one parameter shared by two
    of them) before broadcast_replicas over the world, and after."""
    torch.manual_seed(20 + rank)
    shared = nn.Linear(3, 3).double()
    modules = [
        nn.Sequential(shared, nn.BatchNorm1d(3).double()),
        nn.Sequential(nn.Linear(3, 2).double(), shared),
    ]
    with torch.no_grad():  # BatchNorm's weight and bias too, its step count
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.is_floating_point():
                    tensor.uniform_()
                else:
                    tensor.fill_(rank + 1)

    def state() -> dict[str, Any]:
        return {
            f"{i}.{name}": tensor.tolist()
            for i, module in enumerate(modules)
            for name, tensor in module.state_dict().items()
        }

    before = state()
    guard = _guard("replicas")
    try:
        broadcast_replicas(modules, dist.group.WORLD, guard)
    finally:
        guard.close()
    assert modules[0][0] is modules[1][1], "the shared layer stays shared"
    return {"before": before, "after": state()}


def ties(rank: int, world: int) -> dict[str, Any]:
    """Four cells on two ranks (cells 0, 2 on rank 0; 1, 3 on rank 1) with three ties: a
    weight of cells 0 and 3 (first on rank 0), one of cells 1 and 2 (first on rank 1), and a
    bias of cells 0 and 2 (both on rank 0). Each rank's copies start apart, then
    broadcast_ties: per tie, this rank's copy before and after (None where it holds none)."""
    cells = [nn.Linear(3, 3).double() for _ in range(4)]
    cells[3].weight = cells[0].weight
    cells[2].weight = cells[1].weight
    cells[2].bias = cells[0].bias
    found = find_ties(cells)
    layout = ProcessLayout(dist.group.WORLD, None, (0, 1), rank, 4, (0, 1, 0, 1))
    tied = TiedGradients(cells, found, layout)
    generator = torch.Generator().manual_seed(30 + rank)
    with torch.no_grad():
        for param, *_ in tied.shared:
            if param is not None:
                param.copy_(torch.randn(param.shape, dtype=param.dtype, generator=generator))
    names = [f"{cell}.{name}" for cell, name in (tie.places[0] for tie in found)]
    before = _listed([param for param, *_ in tied.shared])
    guard = _guard("ties")
    try:
        broadcast_ties(tied, layout, guard, torch.device("cpu"))
    finally:
        guard.close()
    after = _listed([param for param, *_ in tied.shared])
    return {"names": names, "before": before, "after": after}

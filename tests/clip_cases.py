"""Cases of pipe.clip_grad_norm_ across ranks (tests/test_clip_processes.py): Linear layers
that share the first one's weight and bias, so that a rank may hold tied copies only."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf

WIDTH = 6


def tied_linears(dtype: torch.dtype, own_last: bool) -> nn.Sequential:
    """Linear+Tanh three times, the second and third Linear using the first one's weight and
    bias, then (`own_last`) a Linear of its own; the same weights on every rank."""
    torch.manual_seed(7)
    first = nn.Linear(WIDTH, WIDTH)
    modules: list[nn.Module] = [first, nn.Tanh()]
    for _ in range(2):
        layer = nn.Linear(WIDTH, WIDTH)
        layer.weight, layer.bias = first.weight, first.bias
        modules += [layer, nn.Tanh()]
    if own_last:
        modules.append(nn.Linear(WIDTH, WIDTH))
    return nn.Sequential(*modules).to(dtype)


def batch(dtype: torch.dtype, size: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(size, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.randn(size, WIDTH, generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def clip_and_step(
    rank: int,
    world: int,
    *,
    dtype: str,
    own_last: bool,
    schedule: str,
    balance: list[int],
    clips: list[tuple[float, Any]],
) -> list[dict[str, Any]]:
    """Per (max_norm, norm_type) of `clips`, on a fresh pipe: one step, the clip's norm and
    its dtype, this rank's clipped gradients, and its parameters after an SGD step (lr 1)."""
    results = []
    for max_norm, norm_type in clips:
        model = tied_linears(getattr(torch, dtype), own_last)
        pipe = gf.GPipe(model, balance, chunks=3, schedule=schedule,
                        pp_group=dist.group.WORLD, timeout=60)  # fmt: skip
        try:
            pipe.train_step(*batch(getattr(torch, dtype)), nn.functional.mse_loss)
            norm = pipe.clip_grad_norm_(max_norm, norm_type)
            state = pipe.state_dict(keep_vars=True)
            grads = {name: p.grad.tolist() for name, p in state.items() if p.grad is not None}
            torch.optim.SGD(pipe.parameters(), lr=1.0).step()
            params = {name: p.tolist() for name, p in pipe.state_dict().items()}
        finally:
            pipe.close()
        results.append(
            {"norm": norm.item(), "dtype": str(norm.dtype), "grads": grads, "params": params}
        )
    return results

"""Cases of tests/test_agreement.py: ranks that build one pipe with different arguments, and
what each rank's build raised."""

from __future__ import annotations

from typing import Any

import dist_cases
import torch
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf

WIDTH = dist_cases.WIDTH


class Stack(nn.Module):
    """Four Linear+tanh blocks in a ModuleList: a model for gf.pipeline with no transformers."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _sequential(odd: bool, argument: str) -> nn.Sequential:
    """dist_cases.model(2); with "parameters" on the odd rank, its inner width is 6."""
    if not (odd and argument == "parameters"):
        return dist_cases.model(2)
    return nn.Sequential(nn.Linear(WIDTH, 6), nn.Tanh(), nn.Linear(6, WIDTH), nn.Tanh()).double()


# Per argument: (the others' value, the odd rank's), as GPipe's keyword arguments.
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "balance": ({"balance": [2, 2]}, {"balance": [1, 3]}),
    "chunks": ({"chunks": 2}, {"chunks": 3}),
    "schedule": ({"schedule": "gpipe"}, {"schedule": "1f1b"}),
    "checkpoint": ({"checkpoint": "except_last"}, {"checkpoint": "never"}),
    "dp_shard": ({"dp_shard": True}, {"dp_shard": False}),
    "dp_shard_sync": (
        {"dp_shard": True, "dp_shard_sync": "per_microbatch"},
        {"dp_shard": True, "dp_shard_sync": "per_step"},
    ),
    "parameters": ({}, {}),
    "split_points": ({"split_points": ["layers.2"]}, {"split_points": ["layers.1"]}),
}


def _build(argument: str, odd: bool, groups: dict[str, Any]) -> Any:
    given = VARIANTS[argument][odd]
    if argument == "split_points":
        x = torch.randn(2, WIDTH)
        return gf.pipeline(Stack(), x, given["split_points"], chunks=2, timeout=60, **groups)
    kwargs = {"balance": [2, 2], "chunks": 2, **given}
    return gf.GPipe(_sequential(odd, argument), timeout=60, **groups, **kwargs)


def disagreeing(rank: int, world: int, *, arguments: list[str]) -> dict[str, str]:
    """For each of `arguments`, the last rank builds with a value the others do not: what
    this rank's build raised ("built" if nothing). Then every rank builds the same pipe and
    trains a step: nothing of the refused builds was left pending in the process group."""
    pp_group, dp_group, _ = dist_cases.groups(2, world // 2)
    groups = {"pp_group": pp_group, "dp_group": dp_group}
    said = {}
    for argument in arguments:
        try:
            _build(argument, rank == world - 1, groups).close()
            said[argument] = "built"
        except ValueError as error:
            said[argument] = str(error)
    pipe = gf.GPipe(dist_cases.model(2), [2, 2], chunks=2, timeout=60, **groups)
    x, y = dist_cases.batch(4, seed=1)
    said["then"] = f"{pipe.train_step(x, y, nn.functional.mse_loss).item():.12f}"
    pipe.close()
    return said


def absent(rank: int, world: int) -> str:
    """Rank 0 builds a pipe that rank 1 never builds (as if it had refused its arguments):
    what rank 0's build raised, waiting 1 s."""
    if rank != 0:
        return "absent"
    try:
        gf.GPipe(dist_cases.model(2), [2, 2], pp_group=dist.group.WORLD, timeout=1)
    except gf.PeerFailure as error:
        return str(error)
    return "built"

"""One rank of a job in which a rank is SIGKILLed mid-step: tests/test_killed_rank.py.

Usage (rank, world and the store's address in the environment, as torchrun sets them, rank 0
hosting the TCP store): python kill_case.py KILLED PP. The job is a (world / PP) x PP mesh of
data-parallel pipelines; rank KILLED dies in a forward of its first step.
Each survivor prints "rank R caught TYPE: MESSAGE" on stderr, then lets the error escape.

The linger at exit (the reporting rank waiting for the others to read its failure) is made
unbounded here: a survivor that waited for the dead rank to read it would hang, and the test
fails on the hang rather than on a measured time.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import gpipe_fast as gf
from gpipe_fast.distributed import guard

guard.LINGER_S = 1e6
WIDTH = 8


class _Die(nn.Module):
    """SIGKILLs its process on rank `rank`, in the forward of micro-batch 2 of a step."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.calls = rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == self.rank and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        return x


def _groups(pp: int) -> tuple[object, object | None]:
    """(pp_group, dp_group) of a (world / pp) x pp mesh."""
    dp = dist.get_world_size() // pp
    if dp == 1:
        return dist.group.WORLD, None
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    return mesh["pp"].get_group(), mesh["dp"].get_group()


def main(killed: int, pp: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pp_group, dp_group = _groups(pp)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(pp):
        layers += [nn.Linear(WIDTH, WIDTH), _Die(killed)]
    pipe = gf.GPipe(nn.Sequential(*layers).double(), [2] * pp, chunks=4, schedule="1f1b",
                    pp_group=pp_group, dp_group=dp_group, timeout=60)  # fmt: skip
    x, y = torch.randn(8, WIDTH, dtype=torch.float64), torch.randn(8, WIDTH, dtype=torch.float64)
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except Exception as error:
        print(f"rank {dist.get_rank()} caught {type(error).__name__}: {error}", file=sys.stderr)
        raise
    print(f"rank {dist.get_rank()} finished", file=sys.stderr)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

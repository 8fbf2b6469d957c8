"""One rank of a job in which a rank is SIGKILLed mid-step: tests/test_killed_rank.py.

Usage (rank, world and the store's address in the environment, as torchrun sets them, rank 0
hosting the TCP store): python kill_case.py KILLED PP [dcp CHECKPOINT]. The job is a (world /
PP) x PP mesh of data-parallel pipelines; rank KILLED dies in a forward of its first step (or,
with dcp, as the DCP save after a step starts: the others run it in pipe.naming_dead_ranks).
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
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
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


def main(killed: int, pp: int, checkpoint: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pp_group, dp_group = _groups(pp)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(pp):
        layers += [nn.Linear(WIDTH, WIDTH), _Die(killed if checkpoint is None else -1)]
    pipe = gf.GPipe(nn.Sequential(*layers).double(), [2] * pp, chunks=4, schedule="1f1b",
                    pp_group=pp_group, dp_group=dp_group, timeout=60)  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = torch.randn(8, WIDTH, dtype=torch.float64), torch.randn(8, WIDTH, dtype=torch.float64)
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
        if checkpoint is not None:
            model_state, optim_state = get_state_dict(pipe, opt)
            if dist.get_rank() == killed:
                os.kill(os.getpid(), signal.SIGKILL)
            with pipe.naming_dead_ranks("the checkpoint's save"):
                dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)
    except Exception as error:
        print(f"rank {dist.get_rank()} caught {type(error).__name__}: {error}", file=sys.stderr)
        raise
    print(f"rank {dist.get_rank()} finished", file=sys.stderr)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4] if sys.argv[3:4] == ["dcp"] else None)

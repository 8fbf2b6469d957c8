"""Cases of tests/test_sharded_comms.py: one rank of a pp x dp job with sharded stages fails in
the middle of a step (raises, dies, or is slow), and what every rank's step raised.

Each stage is Linear, Tanh and a fault that strikes on rank `victim` in the forward of
micro-batch 1 of the second step; the ranks run in the pool (tests/cluster.py) or as a job of
their own (sharded_comms_job.py, where a rank may die)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import dist_cases
import torch
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf

CHUNKS = 2


class Planted(RuntimeError):
    """The error planted on the victim."""


class _Fault(nn.Module):
    """Identity that, on rank `victim`, in the forward of micro-batch 1 of the second step
    (its CHUNKS + 2nd, not counting recomputation), raises, SIGKILLs its process ("kill") or
    sleeps `slow_s` ("slow")."""

    def __init__(self, victim: int, mode: str, slow_s: float) -> None:
        super().__init__()
        self.victim, self.mode, self.slow_s = victim, mode, slow_s
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() != self.victim or gf.is_recomputing():
            return x
        self.calls += 1
        if self.calls == CHUNKS + 2:
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "raise":
                raise Planted(f"planted on rank {self.victim}")
            time.sleep(self.slow_s)
        return x


def sharded_fault(
    rank: int,
    world: int,
    *,
    mode: str,
    victim: int,
    sync: str = "per_microbatch",
    pp: int = 2,
    shard: bool = True,
    timeout: float = 120.0,
    slow_s: float = 0.0,
) -> dict[str, Any]:
    """A step, then a step in which `victim` fails: this rank's error (its type, message) and
    how long that step took to end."""
    pp_group, dp_group, replica = dist_cases.groups(pp, world // pp)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(pp):
        layers += [nn.Linear(dist_cases.WIDTH, dist_cases.WIDTH), nn.Tanh(),
                   _Fault(victim, mode, slow_s)]  # fmt: skip
    sharding: dict[str, Any] = {"dp_shard": True, "dp_shard_sync": sync} if shard else {}
    pipe = gf.GPipe(nn.Sequential(*layers).double(), [3] * pp, chunks=CHUNKS,
                    pp_group=pp_group, dp_group=dp_group, timeout=timeout,
                    **sharding)  # fmt: skip
    replicas = world // pp
    x, y = dist_cases.batch(4 * replicas, seed=1)
    x, y = dist_cases.shard(x, replica, replicas), dist_cases.shard(y, replica, replicas)
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
        start = time.monotonic()
        try:
            pipe.train_step(x, y, nn.functional.mse_loss)
        except Exception as error:
            return {"type": type(error).__name__, "message": str(error),
                    "seconds": time.monotonic() - start, "pid": os.getpid()}  # fmt: skip
        return {"type": "", "message": "", "seconds": time.monotonic() - start,
                "pid": os.getpid()}  # fmt: skip
    finally:
        pipe.close()

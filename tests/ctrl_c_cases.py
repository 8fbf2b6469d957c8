"""Cases of tests/test_ctrl_c_processes.py: Ctrl-C (SIGINT) to one rank of two while rank 0
is inside a slow forward, and what each rank's step raised, how long after the signal.

Rank 0's forward of micro-batch 1 in the second step (its fourth, recomputation aside) is
slow: it writes `folder`/slow, then sleeps until `folder`/release exists (or a minute). The
`target` rank sends itself SIGINT 0.3 s after the slow file appears (writing the time to
`folder`/sent); each rank writes the release file once its own step has raised, so that the
slow forward ends then."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import dist_cases
import torch
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf

CHUNKS = 2
SLOW_FOR_S = 60.0


class _Slow(nn.Module):
    """Identity; on rank 0, in the forward of micro-batch 1 of the second step, slow until
    released."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() != 0 or gf.is_recomputing():
            return x
        self.calls += 1
        if self.calls == CHUNKS + 2:
            (self.folder / "slow").touch()
            deadline = time.monotonic() + SLOW_FOR_S
            while not (self.folder / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        return x


def _interrupt_when_slow(folder: Path, stop: threading.Event) -> None:
    """SIGINT to this process 0.3 s after rank 0's forward turned slow (unless the case
    ended first)."""
    while not (folder / "slow").exists():
        if stop.wait(0.01):
            return
    time.sleep(0.3)
    (folder / "sent").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGINT)


def interrupted(rank: int, world: int, *, target: int, folder: str, shard: bool) -> dict[str, Any]:
    """pp=2 (`shard` False: rank 1 waits for rank 0's activation) or dp=2 with sharded stages
    (rank 1 waits in an all-gather for rank 0): this rank's error and when it came."""
    place = Path(folder)
    torch.manual_seed(0)
    layers = [nn.Linear(dist_cases.WIDTH, dist_cases.WIDTH), nn.Tanh(), _Slow(place),
              nn.Linear(dist_cases.WIDTH, dist_cases.WIDTH), nn.Tanh()]  # fmt: skip
    groups: dict[str, Any] = (
        {"dp_group": dist.group.WORLD, "dp_shard": True}
        if shard
        else {"pp_group": dist.group.WORLD}
    )
    pipe = gf.GPipe(nn.Sequential(*layers).double(), [3, 2], chunks=CHUNKS, timeout=120,
                    **groups)  # fmt: skip
    x, y = dist_cases.batch(4, seed=1)
    stop = threading.Event()
    interrupter = threading.Thread(target=_interrupt_when_slow, args=(place, stop), daemon=True)
    if rank == target:
        interrupter.start()
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
        try:
            pipe.train_step(x, y, nn.functional.mse_loss)
        except BaseException as error:  # KeyboardInterrupt on the target
            raised = time.time()
            (place / "release").touch()
            sent = float((place / "sent").read_text())
            return {"type": type(error).__name__, "message": str(error),
                    "after_sigint": raised - sent}  # fmt: skip
        (place / "release").touch()
        return {"type": "", "message": "", "after_sigint": None}
    finally:
        stop.set()
        if interrupter.is_alive():
            interrupter.join()
        pipe.close()

"""Cases of tests/test_guard.py across processes (tests/cluster.py's pool)."""

from __future__ import annotations

import time

import dist_cases
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf
from gpipe_fast.api.gpipe import pipeline_of
from gpipe_fast.distributed import waiters


def thread_cannot_start(rank: int, world: int, *, starts_s: float) -> tuple[str, str, float]:
    """Replicas (dp over the world) whose rank 1 cannot start the thread its step's first
    gradient sum waits on (as under an address-space cap, where a thread may die as it
    starts): this rank's error type and message, and how long its step took."""
    pipe = gf.GPipe(dist_cases.model(2), [2, 2], chunks=2, dp_group=dist.group.WORLD,
                    timeout=120)  # fmt: skip
    x, y = dist_cases.batch(4, seed=1)
    start_new_thread, start_s = waiters._thread.start_new_thread, waiters.THREAD_START_S
    if rank == 1:  # its threads ended (the build's waits started some), and a thread
        # "started" never runs
        groups = pipeline_of(pipe).groups
        assert groups is not None
        groups.guard._waiters.close()
        waiters._thread.start_new_thread = lambda *args: 0  # type: ignore[assignment]
        waiters.THREAD_START_S = starts_s
    start = time.monotonic()
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - start
    finally:
        waiters._thread.start_new_thread, waiters.THREAD_START_S = start_new_thread, start_s
        pipe.close()
    return "", "", time.monotonic() - start

"""Cases of tests/test_close_processes.py: what a closed pipe across processes leaves behind."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import dist_cases
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf


def _threads() -> list[str]:
    return sorted(thread.name for thread in threading.enumerate())


def threads_after_close(rank: int, world: int, *, pipes: int) -> dict[str, Any]:
    """This rank's Python threads before building `pipes` pipes over the world (one step
    each, then close) and after."""
    gc.collect()
    before = _threads()
    for _ in range(pipes):
        pipe = gf.GPipe(dist_cases.model(2), [2, 2], chunks=2, checkpoint="never",
                        pp_group=dist.group.WORLD, timeout=60)  # fmt: skip
        x, y = dist_cases.batch(4, seed=rank)
        pipe.train_step(x, y, nn.functional.mse_loss)
        pipe.close()
        del pipe
    deadline = time.monotonic() + 10  # a thread told to end may still be unwinding
    while _threads() != before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return {"before": before, "after": _threads()}

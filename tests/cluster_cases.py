"""Cases for tests/test_cluster.py: a worker that dies on purpose, and one that answers."""

from __future__ import annotations

import faulthandler
import os
import sys


def rank_and_pid(rank: int, world: int) -> tuple[int, int]:
    """This worker's rank and process id (a fresh worker has a new one)."""
    return rank, os.getpid()


def dies(rank: int, world: int, *, dying_rank: int, how: str) -> int:
    """`dying_rank` dies without replying: a segmentation fault, or an exit after a message
    on stderr; the others reply."""
    if rank == dying_rank:
        if how == "segfault":
            faulthandler._sigsegv()
        print(f"rank {rank} says goodbye on stderr", file=sys.stderr, flush=True)
        os._exit(7)
    return rank

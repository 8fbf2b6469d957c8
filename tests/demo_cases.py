"""The demo's training across processes, run on each rank of a Cluster (test_demo_processes)."""

from __future__ import annotations

from typing import Any

from gpipe_fast.demo import processes
from gpipe_fast.demo.job import arguments


def train_rank(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """This rank's part of `python -m gpipe_fast demo --processes <world> <argv>`."""
    return processes.train_rank(rank, arguments(["--processes", str(world), *argv]))

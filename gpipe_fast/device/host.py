"""The host's CPU cores for this process, and each CPU cell's share of them."""

from __future__ import annotations

import os

import torch


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_cell(devices: list[torch.device], *, one_worker: bool = False) -> int | None:
    """Each CPU cell's share of the cores, unless the user set OMP_NUM_THREADS. With
    `one_worker` (a process of a multi-process pipe: its cells share one worker) the cores
    are shared by the host's processes instead (LOCAL_WORLD_SIZE, as torchrun sets it)."""
    cpu_cells = sum(device.type == "cpu" for device in devices)
    if cpu_cells == 0 or os.environ.get("OMP_NUM_THREADS"):
        return None
    if one_worker:
        return max(1, cpu_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, cpu_cores() // cpu_cells)

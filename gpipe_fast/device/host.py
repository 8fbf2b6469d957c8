"""The host's CPU cores for this process, and each CPU cell's share of them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# PyTorch's intra-op thread count when gpipe_fast was imported: a count that differs later
# was set by the user (torch.set_num_threads), and is kept.
_IMPORT_THREADS = torch.get_num_threads()
# The count a pipe gave the process's own threads (see share_with_caller): not the user's.
_SHARED_THREADS: int | None = None


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class Threads:
    """The intra-op threads each CPU cell's worker runs with (None: PyTorch's own setting,
    left as it is), and why."""

    per_cell: int | None
    reason: str


def user_threads(given: int | None) -> Threads | None:
    """The user's own thread setting, if any, which a pipe never overrides: `given`
    (GPipe's threads_per_cell), OMP_NUM_THREADS, or torch.set_num_threads since import."""
    if given is not None:
        return Threads(given, f"threads_per_cell={given}, as given")
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp:
        return Threads(None, f"OMP_NUM_THREADS={omp} is set: PyTorch's own setting is kept")
    current = torch.get_num_threads()
    if current not in (_IMPORT_THREADS, _SHARED_THREADS):
        return Threads(None, f"torch.set_num_threads({current}) was called: it is kept")
    return None


def threads_per_cell(
    devices: list[torch.device],
    *,
    processes: int = 1,
    one_worker: bool = False,
    given: int | None = None,
) -> Threads:
    """Each CPU cell's share of the cores, unless the user set a count (user_threads): the
    cores shared by the `processes` of the job on this host and, within this process, by
    its CPU cells' workers (one worker for all, with `one_worker`: a process of a pipeline
    group)."""
    cpu_cells = sum(device.type == "cpu" for device in devices)
    if cpu_cells == 0:
        return Threads(None, "no CPU cell")
    mine = user_threads(given)
    if mine is not None:
        return mine
    cores = cpu_cores()
    workers = 1 if one_worker else cpu_cells
    sharing = [f"{processes} processes of this job on this host"] if processes > 1 else []
    sharing += [f"{cpu_cells} CPU cells"] if workers > 1 else []
    among = " x ".join(sharing) or "this process's one worker"
    return Threads(max(1, cores // (processes * workers)), f"{cores} cores shared by {among}")


def share_with_caller(threads: Threads, processes: int) -> Threads:
    """When the job's `processes` on this host share its cores and nobody set a count
    (`threads` came from threads_per_cell's own rule), the calling thread's intra-op threads
    get this process's share too: the user's optimizer step and whatever else runs on it
    would otherwise use every core in every process (PyTorch's default), several threads per
    core. torchrun's OMP_NUM_THREADS=1 does the same for the whole process."""
    global _SHARED_THREADS
    if processes <= 1 or threads.per_cell is None or user_threads(None) is not None:
        return threads
    share = max(1, cpu_cores() // processes)
    torch.set_num_threads(share)
    _SHARED_THREADS = share
    return Threads(threads.per_cell, f"{threads.reason}; this process's own threads too "
                                     f"(torch.set_num_threads({share}))")  # fmt: skip


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """This thread's intra-op threads set to `threads` (None: left as they are), restored on
    exit."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)

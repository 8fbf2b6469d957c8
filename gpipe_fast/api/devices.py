"""Where a pipe's cells go in one process: default devices and balance, each cell's worker."""

from __future__ import annotations

import torch
from torch import nn

from gpipe_fast.balancing.balance import balance_by_params
from gpipe_fast.device import host
from gpipe_fast.schedule.registry import placement, schedule_kind


class TooFewDevicesError(ValueError, IndexError):
    """Fewer devices than cells. A ValueError, like every bad argument here, and an
    IndexError, which torchgpipe raised for it, so either ``except`` catches it."""


def single_process_devices(
    given: list[torch.device] | None, balance: list[int], schedule: str
) -> tuple[list[torch.device], list[int]]:
    """Each cell's device and worker in one process, placed by the schedule's kind: one
    device (and worker) per cell; for zbv two cells per device, cells s and 2D-1-s on
    devices[s]; for the interleaved schedule V cells per given device, cell s on
    devices[s % D]. Devices beyond those the cells need are left out."""
    per = schedule_kind(schedule).stages_per_worker
    cells = len(balance)
    devices = default_devices(cells, per) if given is None else given
    if not balance:
        return [], []
    if per and cells % per:
        raise ValueError(
            f"balance: the {schedule} schedule runs {per} cells per device, so len(balance) "
            f"({cells}) must be a multiple of {per}"
        )
    if not per and not devices:
        raise TooFewDevicesError(f"devices: {cells} cells need at least one device, got none")
    workers = cells // per if per else len(devices)
    if len(devices) < workers:
        raise TooFewDevicesError(
            f"devices: {cells} cells need {workers} devices, got {len(devices)}"
        )
    if not per and cells % workers:
        raise ValueError(
            f"balance: the {schedule} schedule needs len(balance) ({cells}) to be a multiple "
            f"of len(devices) ({workers}): V cells per device"
        )
    stage_workers = placement(schedule, cells, workers)
    return [devices[w] for w in stage_workers], stage_workers


def default_balance(
    module: nn.Sequential, devices: list[torch.device] | None, schedule: str
) -> list[int]:
    """Balanced by parameter count over one cell per device (see GPipe), or as many per
    device as the schedule runs (two for zbv), at most one per layer; no cells for an empty
    module."""
    if len(module) == 0:
        return []
    if devices is not None:
        available = len(devices)
    elif torch.cuda.is_available():
        available = torch.cuda.device_count()
    else:
        available = host.cpu_cores()
    # With no devices at all, still one cell, so that the device check below names them.
    per = schedule_kind(schedule).stages_per_worker or 1
    workers = max(1, min(available, len(module) // per))
    return balance_by_params(min(len(module), per * workers), module)


def default_devices(cells: int, per: int) -> list[torch.device]:
    """The devices of `cells` cells run `per` to a worker (0: any number, the interleaved
    schedule). Without CUDA one "cpu" device per worker (host.threads_per_cell shares the
    cores out among them). With CUDA every GPU, or, with fewer GPUs than workers, the
    workers share them, contiguous workers on one GPU (all of them on a machine of one GPU,
    each with its own streams); the interleaved schedule takes the most GPUs that divide
    its cells instead, V cells on each."""
    workers = cells // per if per else cells
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * workers
    gpus = torch.cuda.device_count()
    if not per:
        used = max(d for d in range(1, gpus + 1) if cells % d == 0)
        return [torch.device("cuda", i) for i in range(used)]
    if gpus >= workers:
        return [torch.device("cuda", i) for i in range(gpus)]
    return [torch.device("cuda", w * gpus // workers) for w in range(workers)]

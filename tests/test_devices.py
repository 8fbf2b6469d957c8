"""Where cells go by default and which devices are refused: GPUs are counted through a mocked
torch.cuda (this machine may have none), so every placement rule is checked here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast.api.devices import single_process_devices
from gpipe_fast.arguments import check_devices
from gpipe_fast.distributed.layout import check_device


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Makes torch.cuda report `count` GPUs (none: a CPU-only torch), the current one cuda:0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _cuda(*indices: int) -> list[torch.device]:
    return [torch.device("cuda", i) for i in indices]


# (GPUs, schedule, cells) -> each cell's device index, each cell's worker.
PLACEMENTS = [
    (1, "gpipe", 2, [0, 0], [0, 1]),  # the README's example on a machine of one GPU
    (1, "1f1b", 4, [0, 0, 0, 0], [0, 1, 2, 3]),
    (1, "zero_bubble", 3, [0, 0, 0], [0, 1, 2]),
    (1, "zbv", 4, [0, 0, 0, 0], [0, 1, 1, 0]),  # two workers, both on the one GPU
    (1, "interleaved", 4, [0, 0, 0, 0], [0, 0, 0, 0]),  # one worker, V = 4
    (2, "gpipe", 4, [0, 0, 1, 1], [0, 1, 2, 3]),  # neighbouring cells share a GPU
    (3, "1f1b", 4, [0, 0, 1, 2], [0, 1, 2, 3]),
    (4, "gpipe", 2, [0, 1], [0, 1]),  # more GPUs than cells: one each, as before
    (2, "interleaved", 4, [0, 1, 0, 1], [0, 1, 0, 1]),  # V = 2 over both, as before
    (3, "interleaved", 4, [0, 1, 0, 1], [0, 1, 0, 1]),  # the most GPUs dividing 4: two
    (2, "zbv", 4, [0, 1, 1, 0], [0, 1, 1, 0]),
]


@pytest.mark.parametrize(("gpus", "schedule", "cells", "indices", "workers"), PLACEMENTS)
def test_default_devices_place_every_cell_on_the_gpus_there_are(
    monkeypatch: pytest.MonkeyPatch,
    gpus: int,
    schedule: str,
    cells: int,
    indices: list[int],
    workers: list[int],
) -> None:
    _gpus(monkeypatch, gpus)
    devices, stage_workers = single_process_devices(None, [1] * cells, schedule)
    assert devices == _cuda(*indices)
    assert stage_workers == workers


@pytest.mark.parametrize(("schedule", "cells", "count"), [("gpipe", 3, 3), ("zbv", 4, 2)])
def test_default_devices_without_cuda_are_one_cpu_per_worker(
    monkeypatch: pytest.MonkeyPatch, schedule: str, cells: int, count: int
) -> None:
    _gpus(monkeypatch, 0)
    devices, stage_workers = single_process_devices(None, [1] * cells, schedule)
    assert devices == [torch.device("cpu")] * cells
    assert len(set(stage_workers)) == count


def test_cuda_devices_on_a_cpu_only_torch_name_the_argument(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _gpus(monkeypatch, 0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    # It raised torch's AssertionError "Torch not compiled with CUDA enabled" from the copy.
    with pytest.raises(ValueError, match=r"devices\[0\] is cuda:0, but torch.cuda.is_available"):
        gf.GPipe(model, [1, 1], devices=["cuda:0", "cuda:1"])
    with pytest.raises(ValueError, match=r"devices\[1\] is cuda, but torch.cuda.is_available"):
        check_devices(["cpu", "cuda"])
    # Across processes a rank's one device is checked alike.
    with pytest.raises(ValueError, match=r"^devices is cuda:0, but torch.cuda.is_available"):
        check_device(["cuda:0"], None)  # type: ignore[arg-type]


def test_a_gpu_this_process_lacks_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match=r"devices\[1\] is cuda:1, but this process sees 1 CUDA"):
        check_devices(["cuda:0", "cuda:1"])
    assert check_devices(["cuda", "cpu"]) == [torch.device("cuda", 0), torch.device("cpu")]

"""Per-cell memory facts of a pipe: stashed cell inputs, the recompute pool, torch's peak."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

import torch

from gpipe_fast.nn.pytree import tensors_of
from gpipe_fast.runtime.pipeline import Pipeline
from gpipe_fast.runtime.step import Step


class CellMemoryStats(TypedDict):
    """One cell's entry of ``GPipe.memory_stats()``."""

    stash_bytes: int
    recompute_peak_bytes: int | None
    torch_peak_allocated_bytes: int | None


def stash_bytes(steps: Iterable[Step], cell: int) -> int:
    """Bytes of the storages behind `cell`'s stashed inputs in `steps`, each storage counted
    once: a stashed view keeps its whole storage alive (cell 0's micro-batches on the input's
    own device are views of the input), and several views may share one storage."""
    storages: dict[tuple[torch.device, int], int] = {}
    for step in steps:
        stage = step.stages[cell]
        for value in [] if stage is None else stage.inputs:
            if value is None:
                continue
            for tensor in tensors_of(value):
                storage = tensor.untyped_storage()
                storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def memory_stats(pipeline: Pipeline) -> list[CellMemoryStats]:
    """One CellMemoryStats per cell of `pipeline` (see GPipe.memory_stats)."""
    steps = list(pipeline.live_steps)  # a snapshot: the weak set may shrink meanwhile
    return [
        CellMemoryStats(
            stash_bytes=stash_bytes(steps, cell),
            recompute_peak_bytes=(
                None
                if pipeline.recompute_memory is None
                else pipeline.recompute_memory.peak_bytes(cell)
            ),
            torch_peak_allocated_bytes=(
                torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            ),
        )
        for cell, device in enumerate(pipeline.devices)
    ]

"""The runtime's own cost per task, measured through a pipe of cells that do nothing.

gf.plan adds it to every task it prices (cost="time"), so it builds a GPipe: planning sits
above api/ for it."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from gpipe_fast import _C
from gpipe_fast.api.gpipe import GPipe


def task_overhead(
    stages: int, workers: int, chunks: int, schedule: str, *, steps: int = 30, mean: bool = False
) -> float:
    """The runtime's seconds per task, measured: a train_step through `stages` cells that do
    nothing (nn.Identity) on CPU, its median time divided by the makespan its schedule would
    have with one unit per task. Covers what every task pays whatever the layers: the
    executor's hand-offs, the Python task body, the autograd engine's entry. `mean`: the
    steps' mean instead of their median (stalls counted at their rate)."""
    devices = ["cpu"] * workers
    pipe = GPipe(
        nn.Sequential(*[nn.Identity() for _ in range(stages)]),
        [1] * stages,
        devices=devices,
        chunks=chunks,
        checkpoint="never",
        schedule=schedule,
    )
    try:
        x = torch.randn(chunks, 4, requires_grad=True)

        def step() -> None:
            pipe.train_step(x, x, lambda out, target: out.sum())

        for _ in range(3):
            step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        unit = _C.make_schedule(schedule, stages, workers, chunks, "never")
        makespan = _C.simulate(unit, [1.0] * len(unit.tasks)).makespan
        return (statistics.fmean(times) if mean else statistics.median(times)) / makespan
    finally:
        pipe.close()

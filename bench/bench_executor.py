"""Executor overhead per task: pytest bench/bench_executor.py --benchmark-only.

Each benchmark stores ``us_per_task`` (median time / tasks) in its extra_info
(``--benchmark-json`` shows it); bench/README.md records the figures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.device.streams import CellStreams

CELLS, CHUNKS = 2, 32
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and _C.cuda_compiled()), reason="needs a CUDA GPU"
)


def _noop(kind: Any, cell: int, microbatch: int) -> None:
    pass


def _per_task(benchmark: Any, tasks: int) -> None:
    benchmark.extra_info["tasks"] = tasks
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["us_per_task"] = benchmark.stats.stats.median / tasks * 1e6


@pytest.fixture
def executor() -> Iterator[Any]:
    executor = _C.Executor(CELLS)
    yield executor
    executor.close()


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_executor_noop_tasks(benchmark: Any, executor: Any, phase: str) -> None:
    """`_C.Executor(K).run(schedule, fn)` with a Python fn that does nothing."""
    if phase == "forward":
        schedule = _C.gpipe_forward(CELLS, CHUNKS)
    else:
        schedule = _C.gpipe_backward(CELLS, CHUNKS, [True] * (CHUNKS - 1) + [False])
    benchmark(executor.run, schedule, _noop)
    _per_task(benchmark, len(schedule.tasks))


@pytest.fixture
def identity_pipe() -> Iterator[gf.GPipe]:
    pipe = gf.GPipe(
        nn.Sequential(nn.Identity(), nn.Identity()),
        [1, 1],
        devices=["cpu", "cpu"],
        chunks=CHUNKS,
        checkpoint="never",
    )
    yield pipe
    pipe.close()


def test_gpipe_step_identity_cells(benchmark: Any, identity_pipe: gf.GPipe) -> None:
    """A whole GPipe step (forward + backward) whose cells are nn.Identity: the engine's cost.
    Tasks: K*M forward + K*M backward (checkpoint="never")."""
    x = torch.randn(CHUNKS * 4, 16, requires_grad=True)

    def step() -> None:
        identity_pipe(x).sum().backward()

    benchmark(step)
    _per_task(benchmark, 2 * CELLS * CHUNKS)


def test_gpipe_forward_identity_cells_no_grad(benchmark: Any, identity_pipe: gf.GPipe) -> None:
    """The forward alone under torch.no_grad(): K*M tasks."""
    x = torch.randn(CHUNKS * 4, 16)

    def forward() -> None:
        with torch.no_grad():
            identity_pipe(x)

    benchmark(forward)
    _per_task(benchmark, CELLS * CHUNKS)


@needs_cuda
def test_executor_cuda_events_noop_tasks(benchmark: Any) -> None:
    """No-op tasks on the CUDA backend: each task records an event on its cell's stream and
    waits on its producers' (no GPU work), so this is the event record/wait overhead."""
    streams = CellStreams([torch.device("cuda", 0)] * CELLS)
    executor = _C.Executor(CELLS, streams.backend)
    executor.set_streams(streams.native())
    schedule = _C.gpipe_forward(CELLS, CHUNKS)
    try:
        benchmark(executor.run, schedule, _noop)
        torch.cuda.synchronize()
        assert executor.live_events == 0
    finally:
        executor.close()
    _per_task(benchmark, len(schedule.tasks))

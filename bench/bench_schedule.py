"""Schedule generation and simulation speed: pytest bench/bench_schedule.py --benchmark-only."""

from __future__ import annotations

from typing import Any

import pytest

from gpipe_fast import _C

SHAPES = [(8, 32), (64, 256)]
IDS = [f"K{k}-M{m}" for k, m in SHAPES]


@pytest.mark.parametrize(("cells", "chunks"), SHAPES, ids=IDS)
def test_gpipe_forward(benchmark: Any, cells: int, chunks: int) -> None:
    schedule = benchmark(_C.gpipe_forward, cells, chunks)
    assert len(schedule.tasks) == cells * chunks


@pytest.mark.parametrize(("cells", "chunks"), SHAPES, ids=IDS)
def test_gpipe_backward(benchmark: Any, cells: int, chunks: int) -> None:
    recompute = [True] * (chunks - 1) + [False]  # checkpoint="except_last"
    schedule = benchmark(_C.gpipe_backward, cells, chunks, recompute)
    assert len(schedule.tasks) == cells * (2 * chunks - 1)


@pytest.mark.parametrize(("cells", "chunks"), SHAPES, ids=IDS)
def test_simulate_forward(benchmark: Any, cells: int, chunks: int) -> None:
    schedule = _C.gpipe_forward(cells, chunks)
    timeline = benchmark(_C.simulate, schedule, [1.0] * len(schedule.tasks))
    assert timeline.makespan == pytest.approx(chunks + cells - 1)

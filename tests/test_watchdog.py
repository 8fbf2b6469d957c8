"""The step watchdog: a step that overruns step_timeout fails with TimeoutError naming the cell."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from gpipe_fast import _C


class _Stall(nn.Module):
    """Sleeps `seconds` in forward: a slow task that still returns."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def test_slow_step_times_out_naming_the_cell_and_pipe_recovers(make_pipe) -> None:
    stall = _Stall(2.0)
    pipe = make_pipe(
        nn.Sequential(nn.Linear(3, 3), stall), [1, 1], devices=["cpu", "cpu"], chunks=2
    )
    pipe.step_timeout = 0.8
    with pytest.raises(TimeoutError, match=r"cell 1 never finished its forward of micro-batch 0"):
        pipe(torch.randn(4, 3))
    # The stalled task returned within the grace period, so the pipe still works.
    stall.seconds = 0.0
    pipe(torch.randn(4, 3)).sum().backward()
    assert pipe.partitions[0][0].weight.grad is not None


def test_stuck_task_leaves_the_pipe_unusable_with_a_clear_error(make_pipe) -> None:
    release = threading.Event()  # only the test opens it, after the TimeoutError
    inside = threading.Event()
    left = threading.Event()

    class Stuck(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inside.set()
            release.wait(timeout=60)  # a bound, so a broken watchdog fails instead of hanging
            left.set()
            return x

    pipe = make_pipe(
        nn.Sequential(Stuck(), nn.Identity()), [1, 1], devices=["cpu", "cpu"], chunks=1
    )
    pipe.step_timeout = 0.2
    try:
        with pytest.raises(TimeoutError, match="cell 0 never finished its forward") as caught:
            pipe(torch.randn(2, 3))
        # The watchdog did not wait for the stuck task: it is still inside its wait.
        assert inside.is_set()
        assert not left.is_set()
        assert "no longer run steps" in str(caught.value)
        with pytest.raises(ValueError, match="abandoned"):
            pipe(torch.randn(2, 3))
    finally:
        release.set()  # let the left-behind worker finish so the test process stays tidy
    assert left.wait(timeout=60)


def test_waiting_cells_are_reported() -> None:
    executor = _C.Executor(2)
    release = threading.Event()

    def task(kind: object, cell: int, microbatch: int) -> None:
        if cell == 0:
            release.wait(timeout=1.0)

    with pytest.raises(TimeoutError, match="cell 1 was waiting to start its forward"):
        executor.run(_C.gpipe_forward(2, 1), task, timeout_s=0.2)
    release.set()
    executor.run(_C.gpipe_forward(2, 1), task)  # usable again: the slow task returned
    executor.close()


@pytest.mark.parametrize(
    ("value", "error"), [(0, ValueError), (-1.0, ValueError), ("1", TypeError), (True, TypeError)]
)
def test_step_timeout_validation(make_pipe, value: object, error: type) -> None:
    pipe = make_pipe(nn.Sequential(nn.Identity()), [1], devices=["cpu"])
    with pytest.raises(error, match="step_timeout"):
        pipe.step_timeout = value
    pipe.step_timeout = 2
    assert pipe.step_timeout == 2.0
    pipe.step_timeout = None
    assert pipe.step_timeout is None

"""Soak: a thousand training steps leave threads, native events and memory flat after warm-up."""

from __future__ import annotations

import gc
import os

import torch
from torch import nn

from helpers import native_threads, no_hang

STEPS = 1000
FAIL_EVERY = 100  # one step in a hundred fails in cell 1's forward: the error path leaks nothing
MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _FailWhenArmed(nn.Module):
    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("planted")
        return x


def test_thousand_steps_leave_threads_events_and_memory_flat(make_pipe) -> None:
    fail = _FailWhenArmed()
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 8), fail, nn.Tanh()
    )
    pipe = make_pipe(model, [3, 3], devices=["cpu"] * 2, chunks=4)  # recomputes all but one
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    executor = pipe._pipeline.executor
    x = torch.randn(16, 8)

    def step(i: int) -> None:
        optimizer.zero_grad()
        fail.armed = i % FAIL_EVERY == FAIL_EVERY - 1
        try:
            pipe(x).sum().backward()
        except RuntimeError as error:
            assert fail.armed and "planted" in str(error)
            return
        assert not fail.armed
        optimizer.step()

    def snapshot() -> tuple[int, int, int]:
        return native_threads(), executor.live_events, executor.pooled_events

    with no_hang(300):
        for i in range(100):  # warm-up: allocator pools, lazy imports, per-thread state
            step(i)
        gc.collect()
        settled, runs, rss_warm = snapshot(), executor.runs, _rss()
        for i in range(STEPS):
            step(i)
            if i == STEPS // 2:
                gc.collect()
                rss_half = _rss()
                assert snapshot() == settled
        gc.collect()
        assert snapshot() == settled  # threads (the watchdog's too), live and pooled events
    assert executor.live_events == 0
    failed = STEPS // FAIL_EVERY
    assert executor.runs - runs == 2 * (STEPS - failed) + failed  # a failed step runs once
    rss_end = _rss()
    # Memory: none of the steps may keep anything; allocators settle during the first half.
    assert rss_end - rss_half < 4 * MiB, (rss_warm, rss_half, rss_end)
    assert rss_end - rss_warm < 16 * MiB, (rss_warm, rss_half, rss_end)
    assert all(p.isfinite().all() for p in model.parameters())


def test_thousand_forward_only_runs_under_no_grad(make_pipe) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    pipe = make_pipe(model, [2, 1], devices=["cpu"] * 2, chunks=4)
    executor = pipe._pipeline.executor
    x = torch.randn(16, 8)
    with no_hang(300), torch.no_grad():
        for _ in range(100):
            pipe(x)
        gc.collect()
        threads, rss_warm = native_threads(), _rss()
        for _ in range(STEPS):
            pipe(x)
        gc.collect()
        assert native_threads() == threads
    assert executor.live_events == 0
    assert _rss() - rss_warm < 4 * MiB

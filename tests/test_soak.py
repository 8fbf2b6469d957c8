"""Soak: a thousand training steps leave threads, events, live objects and memory flat after
warm-up; on a GPU, also the pooled CUDA events and the device's allocated memory."""

from __future__ import annotations

import gc
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import skip_models
import torch
from torch import nn

from gpipe_fast.api.gpipe import pipeline_of
from gpipe_fast.nn import randomness

from helpers import native_threads, no_hang

STEPS = 1000
FAIL_EVERY = 100  # one step in a hundred fails in cell 1's forward: the error path leaks nothing
MiB = 1 << 20

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live_objects() -> Counter[str]:
    """Python objects a leaked step would keep: tensors, gpipe_fast's own objects (steps,
    timelines, randomness modes), and autograd contexts of custom Functions (the pipe's
    _Enter/_Exit among them)."""
    gc.collect()
    counts: Counter[str] = Counter()
    for obj in gc.get_objects():
        kind = type(obj)
        if issubclass(kind, torch.Tensor):
            counts["tensor"] += 1
        elif issubclass(kind, torch.autograd.function.BackwardCFunction):
            counts["autograd context"] += 1
        else:
            module = getattr(kind, "__module__", None)  # not always a string on odd types
            if isinstance(module, str) and module.startswith("gpipe_fast"):
                counts[f"{module}.{kind.__qualname__}"] += 1
    return counts


class _FailWhenArmed(nn.Module):
    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("planted")
        return x


def _soak(
    make_pipe: Any,
    device: str,
    snapshot: Callable[[Any], tuple[object, ...]],
    **options: Any,
) -> None:
    """Runs a hundred warm-up steps, then STEPS more (one in FAIL_EVERY failing), of a pipe
    built with `options`, and checks that `snapshot(pipe)` and the live objects are what
    they were after warm-up, halfway and at the end."""
    fail = _FailWhenArmed()
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 8), fail, nn.Tanh()
    ).to(device)
    # Recomputes all micro-batches but the last.
    pipe = make_pipe(model, [3, 3], devices=[device] * 2, chunks=4, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    executor = pipeline_of(pipe).executor
    x = torch.randn(16, 8, device=device)

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

    def state() -> tuple[tuple[object, ...], Counter[str]]:
        # The same point after every step, failed or not: no gradients (a failed step left
        # none), garbage collected (by the census) before the snapshot reads memory.
        optimizer.zero_grad()
        objects = _live_objects()
        return snapshot(pipe), objects

    with no_hang(300):
        for i in range(100):  # warm-up: allocator pools, lazy imports, per-thread state
            step(i)
        settled = state()
        runs, rss_warm = executor.runs, _rss()
        assert settled[1]["tensor"] > 0  # the census sees the model's parameters and `x`
        for i in range(STEPS):
            step(i)
            if i == STEPS // 2:
                assert state() == settled
                rss_half = _rss()
        # No step, tensor or autograd context left behind; snapshot(executor) flat.
        assert state() == settled
    assert executor.live_events == 0
    failed = STEPS // FAIL_EVERY
    assert executor.runs - runs == 2 * (STEPS - failed) + failed  # a failed step runs once
    rss_end = _rss()
    # Memory: none of the steps may keep anything; allocators settle during the first half.
    assert rss_end - rss_half < 4 * MiB, (rss_warm, rss_half, rss_end)
    assert rss_end - rss_warm < 16 * MiB, (rss_warm, rss_half, rss_end)
    assert all(p.isfinite().all() for p in model.parameters())


def test_thousand_steps_leave_threads_events_objects_and_memory_flat(make_pipe) -> None:
    def snapshot(pipe: Any) -> tuple[object, ...]:
        # Threads (the watchdog's too), the host sync's live events, and whether the default
        # generators are free between steps (a task that left them held would stall the next
        # step's random cells).
        generators_free = randomness._HELD.acquire(blocking=False)
        if generators_free:
            randomness._HELD.release()
        return native_threads(), pipeline_of(pipe).executor.live_events, generators_free

    _soak(make_pipe, "cpu", snapshot)


@needs_cuda
@pytest.mark.parametrize("recompute_pool", [False, True], ids=["caching-allocator", "pool"])
def test_thousand_steps_on_cuda_leave_events_pools_and_device_memory_flat(
    make_pipe, recompute_pool: bool
) -> None:
    def snapshot(pipe: Any) -> tuple[object, ...]:
        torch.cuda.synchronize()
        executor, copier = pipeline_of(pipe).executor, pipeline_of(pipe).streams.copier
        return (
            native_threads(),
            executor.live_events,
            executor.pooled_events,  # the CUDA sync reuses its events: the pool stops growing
            copier.live_events,
            copier.pooled_events,  # so do the boundary copier's
            # The recompute pools' high-water marks: reused from step to step, never grown.
            tuple(cell["recompute_peak_bytes"] for cell in pipe.memory_stats()),
            torch.cuda.memory_allocated(),
        )

    _soak(make_pipe, "cuda:0", snapshot, recompute_pool=recompute_pool)


def test_thousand_forward_only_runs_under_no_grad(make_pipe) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    pipe = make_pipe(model, [2, 1], devices=["cpu"] * 2, chunks=4)
    executor = pipeline_of(pipe).executor
    x = torch.randn(16, 8)
    with no_hang(300), torch.no_grad():
        for _ in range(100):
            pipe(x)
        threads, objects, rss_warm = native_threads(), _live_objects(), _rss()
        for _ in range(STEPS):
            pipe(x)
        assert native_threads() == threads
        assert _live_objects() == objects
    assert executor.live_events == 0
    assert _rss() - rss_warm < 4 * MiB


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_thousand_steps_with_skips_leave_no_skip_tensor(make_pipe, schedule: str) -> None:
    # A U-Net whose skips cross cells (Down in cells 0 and 1, their Ups in cell 2), with
    # recomputation and, under zero_bubble, a split backward: after every step the census
    # (tensors, gpipe_fast's objects, skip trackers among them) is what it was after warm-up.
    model = skip_models.unet(2).double()
    pipe = make_pipe(model, [1, 2, 2], devices=["cpu"] * 3, chunks=4, schedule=schedule,
                     checkpoint="except_last")  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(12, skip_models.WIDTH, dtype=torch.float64)
    y = torch.randn_like(x)

    def step() -> None:
        optimizer.zero_grad()
        pipe.train_step(x, y, nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad()  # the census sees no gradient

    with no_hang(300):
        for _ in range(100):
            step()
        threads, objects = native_threads(), _live_objects()
        assert any(key.startswith("gpipe_fast.skip") for key in objects)  # it sees skip objects
        for i in range(STEPS):
            step()
            if i == STEPS // 2:
                assert _live_objects() == objects
        assert native_threads() == threads
        assert _live_objects() == objects
    assert pipeline_of(pipe).executor.live_events == 0
    assert all(p.isfinite().all() for p in model.parameters())

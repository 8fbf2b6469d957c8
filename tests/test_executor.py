"""The native executor from Python: cells run at once on their own threads, errors come back."""

from __future__ import annotations

import threading

import pytest

from gpipe_fast import _C


def test_cells_run_concurrently_on_distinct_threads() -> None:
    executor = _C.Executor(2)
    both_inside = threading.Barrier(2, timeout=10)
    threads: dict[int, set[int]] = {0: set(), 1: set()}

    def task(kind: object, cell: int, microbatch: int) -> None:
        threads[cell].add(threading.get_ident())
        if (microbatch == 0 and cell == 0) or (microbatch == 1 and cell == 1):
            both_inside.wait()  # F(0,1)... meets F(1,0): only possible if they overlap

    # Cell 0's second task overlaps cell 1's first only if the workers really run at once.
    schedule = _C.gpipe_forward(2, 3)
    order_hits: list[tuple[int, int]] = []

    def overlapping(kind: object, cell: int, microbatch: int) -> None:
        order_hits.append((cell, microbatch))
        threads[cell].add(threading.get_ident())
        if (cell, microbatch) in ((0, 1), (1, 0)):
            both_inside.wait()

    executor.run(schedule, overlapping)
    assert len(threads[0]) == 1 and len(threads[1]) == 1 and threads[0] != threads[1]
    assert threading.get_ident() not in threads[0] | threads[1]
    assert sorted(order_hits) == [(c, m) for c in range(2) for m in range(3)]
    executor.close()
    del task


def test_first_error_keeps_its_type_and_executor_recovers() -> None:
    executor = _C.Executor(3)
    schedule = _C.gpipe_forward(3, 4)
    ran: list[tuple[int, int]] = []

    def failing(kind: object, cell: int, microbatch: int) -> None:
        if (cell, microbatch) == (1, 2):
            raise KeyError("boom")
        ran.append((cell, microbatch))

    with pytest.raises(KeyError, match="boom"):
        executor.run(schedule, failing)
    assert (2, 2) not in ran and (2, 3) not in ran  # dependents of the failed task never ran
    ran.clear()
    executor.run(schedule, lambda kind, cell, m: ran.append((cell, m)))
    assert len(ran) == 12
    assert executor.live_events == 0
    assert executor.runs == 2
    executor.close()


def test_recording_gives_spans_that_respect_dependencies() -> None:
    executor = _C.Executor(2)
    executor.set_recording(True)
    schedule = _C.gpipe_forward(2, 3)
    executor.run(schedule, lambda kind, cell, m: None)
    spans = {task: (start, end) for task, start, end in executor.last_spans()}
    assert sorted(spans) == list(range(len(schedule.tasks)))
    for task_id, task in enumerate(schedule.tasks):
        for dep in task.deps:
            assert spans[dep][1] <= spans[task_id][0]
    assert executor.worker_clocks() == ["host", "host"]  # the host backend: the steady clock
    assert executor.live_timing_events == executor.pooled_timing_events == 0
    executor.close()


def test_closed_executor_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="backend"):
        _C.Executor(1, "tpu")
    with pytest.raises(ValueError, match="worker"):
        _C.Executor(0)
    executor = _C.Executor(2)
    with pytest.raises(ValueError, match="3 workers but the executor has 2"):
        executor.run(_C.gpipe_forward(3, 1), lambda *a: None)
    executor.close()
    with pytest.raises(ValueError, match="closed"):
        executor.run(_C.gpipe_forward(2, 1), lambda *a: None)


def test_workers_are_joined_on_close() -> None:
    before = threading.active_count()
    native_before = _native_threads()
    executors = [_C.Executor(4) for _ in range(5)]
    for executor in executors:
        executor.run(_C.gpipe_forward(4, 2), lambda *a: None)
    assert _native_threads() >= native_before + 20
    for executor in executors:
        executor.close()
    assert _native_threads() == native_before
    assert threading.active_count() == before


def _native_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))

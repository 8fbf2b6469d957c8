"""A pipe's schedule cache: each schedule built once per key, the one the native builders give,
and the least recently used dropped beyond the capacity."""

from __future__ import annotations

from typing import Any

import pytest

from gpipe_fast import _C
from gpipe_fast.schedule.cache import ScheduleCache
from gpipe_fast.schedule.registry import recomputed


def _tasks(schedule: Any) -> list[tuple[int, int, int, int, list[int]]]:
    return [(t.action, t.stage, t.microbatch, t.worker, list(t.deps)) for t in schedule.tasks]


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_a_train_step_is_the_kinds_schedule_built_once(checkpoint: str) -> None:
    cache = ScheduleCache([0, 1, 0, 1], "interleaved")
    schedule, flags = cache.train_step(4, checkpoint)
    want = _C.make_schedule("interleaved", 4, 2, 4, checkpoint)
    assert _tasks(schedule) == _tasks(want)
    assert flags == recomputed(want)
    assert cache.train_step(4, checkpoint)[0] is schedule  # kept, not built again
    assert cache.train_step(5, checkpoint)[0] is not schedule  # another key, another build
    assert not cache.lowered


def test_pipe_x_runs_fill_drain_forward_and_backward_on_the_stage_workers() -> None:
    cache = ScheduleCache([0, 0, 1], "gpipe")
    forward = cache.forward(3)
    assert _tasks(forward) == _tasks(_C.gpipe_forward(3, 3, [0, 0, 1]))
    flags = (True, False, True)
    backward = cache.backward(flags)
    assert _tasks(backward) == _tasks(_C.gpipe_backward(3, 3, list(flags), [0, 0, 1]))
    assert cache.forward(3) is forward and cache.backward(flags) is backward
    assert cache.backward((False, False, True)) is not backward


@pytest.mark.parametrize("loss", [True, False])
def test_an_evaluation_runs_the_kinds_forwards(loss: bool) -> None:
    cache = ScheduleCache([0, 1], "1f1b")
    run = cache.forward_only(4, loss=loss)
    assert _tasks(run) == _tasks(_C.forward_schedule("1f1b", 2, 2, 4, loss))
    assert cache.forward_only(4, loss=loss) is run


def test_a_lowered_pipe_runs_this_ranks_schedule() -> None:
    # Two ranks, one stage each: rank 1's program, with its receives and sends.
    cache = ScheduleCache([0, 1], "1f1b", worker_ranks=[0, 1], rank=1)
    assert cache.lowered
    schedule, flags = cache.train_step(3, "except_last")
    want = _C.rank_schedule("1f1b", 2, 2, 3, "except_last", [0, 1], False, 1, [], [])
    assert _tasks(schedule) == _tasks(want)
    assert flags == recomputed(want)
    names = _C.actions()
    assert {names[t.action] for t in schedule.tasks} >= {"recv_forward", "send_backward"}
    # pipe(x) of a lowered pipe is its forward-only run without the loss.
    forward = cache.forward(3)
    assert forward is cache.forward_only(3, loss=False)
    want_forward = _C.rank_forward_schedule("1f1b", 2, 2, 3, False, [0, 1], 1, [], [])
    assert _tasks(forward) == _tasks(want_forward)


def test_reduce_grad_alone_lowers_the_step() -> None:
    # dp_group without pp_group: one rank runs every stage, and reduces the gradients.
    cache = ScheduleCache([0, 1], "gpipe", reduce_grad=True)
    assert cache.lowered
    schedule, _ = cache.train_step(2, "never")
    names = _C.actions()
    assert "reduce_grad" in {names[t.action] for t in schedule.tasks}


def test_the_least_recently_used_is_dropped_beyond_the_capacity() -> None:
    cache = ScheduleCache([0, 1], "gpipe", capacity=2)
    first, _ = cache.train_step(1, "never")
    second, _ = cache.train_step(2, "never")
    assert cache.train_step(1, "never")[0] is first  # 1 is now the most recent
    cache.train_step(3, "never")  # a third: 2, the least recent, goes
    assert cache.train_step(1, "never")[0] is first
    rebuilt, _ = cache.train_step(2, "never")
    assert rebuilt is not second and _tasks(rebuilt) == _tasks(second)

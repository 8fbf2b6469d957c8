"""The native schedules through the bindings: exact task lists, validation, the simulator."""

from __future__ import annotations

import pytest

from gpipe_fast import _C

F, R, B = _C.TaskKind.Forward, _C.TaskKind.Recompute, _C.TaskKind.Backward


def _listing(schedule: _C.Schedule) -> list[tuple[object, int, int, list[int]]]:
    return [(t.kind, t.cell, t.microbatch, list(t.deps)) for t in schedule.tasks]


def test_fill_drain_forward() -> None:
    assert _listing(_C.gpipe_forward(2, 2)) == [
        (F, 0, 0, []),
        (F, 0, 1, []),
        (F, 1, 0, [0]),
        (F, 1, 1, [1]),
    ]


def test_fill_drain_backward_with_recompute() -> None:
    schedule = _C.gpipe_backward(2, 2, [True, False])
    assert _listing(schedule) == [
        (B, 1, 1, []),
        (R, 1, 0, []),
        (B, 1, 0, []),
        (B, 0, 1, [0]),
        (R, 0, 0, []),
        (B, 0, 0, [2]),
    ]
    assert schedule.order(0) == [3, 4, 5]


def test_validate_rejects_a_cycle_through_cell_order() -> None:
    schedule = _C.Schedule(2, 2)
    schedule.add(F, 0, 0, [3])
    schedule.add(F, 0, 1)
    schedule.add(F, 1, 0, [1])
    schedule.add(F, 1, 1)
    with pytest.raises(ValueError, match="cycle"):
        schedule.validate()


@pytest.mark.parametrize(("cells", "chunks"), [(1, 1), (2, 4), (4, 8), (3, 32)])
def test_simulated_bubble_is_the_gpipe_formula(cells: int, chunks: int) -> None:
    schedule = _C.gpipe_forward(cells, chunks)
    timeline = _C.simulate(schedule, [1.0] * len(schedule.tasks))
    assert timeline.makespan == chunks + cells - 1
    assert timeline.bubble == pytest.approx((cells - 1) / (chunks + cells - 1))

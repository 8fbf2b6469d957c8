"""The native schedules through the bindings: programs, linking, validation, dry run, simulator."""

from __future__ import annotations

import random

import pytest

from gpipe_fast import _C

ACTIONS = _C.actions()
LETTER = {"forward": "F", "recompute": "R", "backward": "B", "backward_input": "I",
          "backward_weight": "W", "loss": "L"}  # fmt: skip


def _show(program: list[list[tuple[str, int, int]]]) -> list[str]:
    return [" ".join(f"{LETTER[a]}{s}.{m}" for a, s, m in steps) for steps in program]


def _orders(schedule: _C.Schedule) -> list[str]:
    return [
        " ".join(
            f"{LETTER[ACTIONS[schedule.tasks[i].action]]}{schedule.tasks[i].stage}."
            f"{schedule.tasks[i].microbatch}"
            for i in schedule.order(w)
        )
        for w in range(schedule.workers)
    ]


def test_actions_are_named_and_indexed() -> None:
    for name in ("forward", "recompute", "backward", "backward_input", "backward_weight", "loss"):
        assert name in ACTIONS
    assert ACTIONS.index("forward") == 0


def test_1f1b_program_by_hand() -> None:
    assert _show(_C.program("1f1b", 3, 3, 4)) == [
        "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3",
        "F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3",
        "F2.0 L2.0 B2.0 F2.1 L2.1 B2.1 F2.2 L2.2 B2.2 F2.3 L2.3 B2.3",
    ]


def test_gpipe_program_with_checkpoint_always_recomputes_ahead() -> None:
    assert _show(_C.program("gpipe", 2, 2, 3, "always")) == [
        "F0.0 F0.1 F0.2 R0.2 R0.1 B0.2 R0.0 B0.1 B0.0",
        "F1.0 L1.0 F1.1 L1.1 F1.2 L1.2 R1.2 R1.1 B1.2 R1.0 B1.1 B1.0",
    ]


def test_zero_bubble_program_by_hand() -> None:
    assert _show(_C.program("zero_bubble", 2, 2, 3)) == [
        "F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 I0.2 W0.2",
        "F1.0 L1.0 I1.0 F1.1 L1.1 I1.1 W1.0 F1.2 L1.2 I1.2 W1.1 W1.2",
    ]


def test_interleaved_program_by_hand_and_uneven_microbatches() -> None:
    # 4 stages on 2 workers, 3 micro-batches (not a multiple of 2): one group of 3.
    assert _show(_C.program("interleaved", 4, 2, 3)) == [
        "F0.0 F0.1 F0.2 F2.0 F2.1 F2.2 B2.0 B2.1 B2.2 B0.0 B0.1 B0.2",
        "F1.0 F1.1 F1.2 F3.0 L3.0 B3.0 F3.1 L3.1 B3.1 F3.2 L3.2 B3.2 B1.0 B1.1 B1.2",
    ]


def test_make_schedule_links_and_validates() -> None:
    schedule = _C.make_schedule("interleaved", 4, 2, 3, "never")
    assert (schedule.stages, schedule.workers, schedule.microbatches) == (4, 2, 3)
    assert schedule.stage_workers == [0, 1, 0, 1]
    assert _orders(schedule) == _show(_C.program("interleaved", 4, 2, 3))
    for task in schedule.tasks:
        assert task.worker == task.stage % 2
        for dep in task.deps:
            assert 0 <= dep < len(schedule.tasks)


def test_forward_only_schedules_hold_forwards_and_losses_only() -> None:
    assert _show(_C.forward_program("zero_bubble", 2, 2, 3)) == [
        "F0.0 F0.1 F0.2",
        "F1.0 L1.0 F1.1 L1.1 F1.2 L1.2",
    ]
    schedule = _C.forward_schedule("interleaved", 4, 2, 3, loss=False)
    assert _orders(schedule) == _show(_C.forward_program("interleaved", 4, 2, 3, loss=False))
    assert {ACTIONS[t.action] for t in schedule.tasks} == {"forward"}
    # Rank 1 of two (stages 1 and 3): its forwards with their sends, the activations it
    # receives on its first communication worker, nothing on the second.
    rank = _C.rank_forward_schedule("interleaved", 4, 2, 3, True, [0, 1], 1)
    assert rank.workers == 3 and rank.stage_workers == [-1, 0, -1, 0]
    names = [[ACTIONS[rank.tasks[i].action] for i in rank.order(w)] for w in range(3)]
    assert set(names[0]) == {"forward", "send_forward", "loss"}
    assert names[1] == ["recv_forward"] * 6 and names[2] == []


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("2f2b", 2, 2, 4), "schedule must be"),
        (("gpipe", 3, 2, 4), "one stage per worker"),
        (("interleaved", 5, 2, 4), "multiple of workers"),
        (("1f1b", 2, 2, 0), "microbatches must be >= 1"),
    ],
)
def test_make_schedule_rejects_bad_layouts(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _C.make_schedule(*args)


def test_validate_names_a_deadlock() -> None:
    # Worker 0: B0.0 before F0.1; worker 1: F1.1 before B1.0.
    program = [
        [("forward", 0, 0), ("backward", 0, 0), ("forward", 0, 1), ("backward", 0, 1)],
        [("forward", 1, 0), ("loss", 1, 0), ("forward", 1, 1), ("loss", 1, 1),
         ("backward", 1, 1), ("backward", 1, 0)],
    ]  # fmt: skip
    schedule = _C.link(program, 2, 2)
    assert len(_C.dry_run(schedule)) == 2
    with pytest.raises(ValueError, match=r"deadlocks.*worker 0 waits at backward\(stage 0"):
        schedule.validate()


def test_validate_rejects_backward_before_forward() -> None:
    schedule = _C.link([[("backward", 0, 0), ("forward", 0, 0)]], 1, 1, given=["loss"])
    with pytest.raises(ValueError, match="which its worker runs after it"):
        schedule.validate()


def test_dry_run_finds_no_deadlock_on_random_layouts() -> None:
    rng = random.Random(1123)
    for _ in range(200):
        workers, chunks, microbatches = rng.randint(1, 6), rng.randint(1, 3), rng.randint(1, 17)
        kind = rng.choice(["gpipe", "1f1b", "zero_bubble", "interleaved"])
        stages = workers * chunks if kind == "interleaved" else workers
        checkpoint = rng.choice(["never", "except_last", "always"])
        schedule = _C.make_schedule(kind, stages, workers, microbatches, checkpoint)
        assert _C.dry_run(schedule) == []


@pytest.mark.parametrize(("cells", "chunks"), [(1, 1), (2, 4), (4, 8), (3, 32)])
def test_simulated_bubble_is_the_gpipe_formula(cells: int, chunks: int) -> None:
    schedule = _C.gpipe_forward(cells, chunks)
    timeline = _C.simulate(schedule, [1.0] * len(schedule.tasks))
    assert timeline.makespan == chunks + cells - 1
    assert timeline.bubble == pytest.approx((cells - 1) / (chunks + cells - 1))


def test_phase_schedules_with_several_stages_per_worker() -> None:
    forward = _C.gpipe_forward(4, 2, [0, 1, 0, 1])
    assert _orders(forward) == ["F0.0 F0.1 F2.0 F2.1", "F1.0 F1.1 F3.0 F3.1"]
    backward = _C.gpipe_backward(4, 2, [False, False], [0, 1, 0, 1])
    assert _orders(backward) == ["B2.1 B2.0 B0.1 B0.0", "B3.1 B3.0 B1.1 B1.0"]

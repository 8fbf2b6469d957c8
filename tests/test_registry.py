"""The native registry seen from Python: schedule kinds and their placement, ZB-V's cells and
in-flight bound, ideal bubbles, and actions registered at run time as data."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.api.devices import TooFewDevicesError
from gpipe_fast.api.gpipe import pipeline_of
from gpipe_fast.planning.predict import StageCosts, task_costs
from gpipe_fast.runtime.stage import Stage
from gpipe_fast.runtime.step import Step
from gpipe_fast.runtime.timeline import TaskSpan, Timeline
from gpipe_fast.schedule import registry as schedules
from gpipe_fast.schedule.registry import Need

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from schedule_memory import Counter

_names = (f"registry_test_{n}" for n in itertools.count())


def _model(layers: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(3, 3) for _ in range(layers)]).double()


# -- schedule kinds ----------------------------------------------------------------------------


def test_schedules_and_their_facts_come_from_the_native_registry() -> None:
    assert schedules.schedules() == tuple(kind.name for kind in _C.schedule_kinds())
    assert schedules.builtin_schedules() == ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")
    zbv = schedules.schedule_kind("zbv")
    assert (zbv.stages_per_worker, zbv.split_backward) == (2, True)
    assert schedules.schedule_kind("interleaved").stages_per_worker == 0
    assert not schedules.schedule_kind("1f1b").split_backward
    assert schedules.placement("zbv", 6, 3) == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ValueError, match="schedule must be one of"):
        schedules.schedule_kind("2f2b")


def test_zbv_runs_cells_s_and_2d_minus_1_minus_s_on_one_device(make_pipe: Any) -> None:
    pipe = make_pipe(_model(6), [1] * 6, devices=["cpu"] * 3, schedule="zbv")
    assert pipeline_of(pipe).stage_workers == [0, 1, 2, 2, 1, 0]
    # Devices beyond the cells' need are left out, as for one cell per device.
    more = make_pipe(_model(4), [1] * 4, devices=["cpu"] * 5, schedule="zbv")
    assert pipeline_of(more).stage_workers == [0, 1, 1, 0]
    assert len(more.devices) == 4


def test_zbv_layouts_it_cannot_run_name_the_argument(make_pipe: Any) -> None:
    with pytest.raises(ValueError, match=r"balance: the zbv schedule runs 2 cells per device"):
        make_pipe(_model(3), [1] * 3, devices=["cpu"] * 2, schedule="zbv")
    with pytest.raises(TooFewDevicesError, match="devices: 4 cells need 2 devices, got 1"):
        make_pipe(_model(4), [1] * 4, devices=["cpu"], schedule="zbv")
    with pytest.raises(ValueError, match="partitions: schedule 'zbv' runs 2 stages per worker"):
        gf.plan(_model(3), torch.randn(4, 3, dtype=torch.float64), 3, 2, schedule="zbv",
                cost="params")  # fmt: skip
    with pytest.raises(ValueError, match="devices: schedule 'zbv' runs 2 stages per worker"):
        gf.plan(_model(4), torch.randn(4, 3, dtype=torch.float64), 4, 2, schedule="zbv",
                cost="params", devices=4)  # fmt: skip


def test_interleaved_without_devices_names_them(make_pipe: Any) -> None:
    # It divided len(balance) by len(devices): ZeroDivisionError.
    with pytest.raises(TooFewDevicesError, match="devices: 2 cells need at least one"):
        make_pipe(_model(2), [1, 1], devices=[], schedule="interleaved")


def test_zbv_by_default_runs_two_cells_per_device(make_pipe: Any) -> None:
    pipe = make_pipe(_model(8), devices=["cpu"] * 2, schedule="zbv")
    assert len(pipe.balance) == 4
    assert pipeline_of(pipe).stage_workers == [0, 1, 1, 0]
    plan = gf.plan(_model(8), torch.randn(4, 3, dtype=torch.float64), 4, 2, schedule="zbv",
                   cost="params")  # fmt: skip
    # Equal cells (by parameters), no overheads: the kind's ideal bubble.
    assert plan.bubble == pytest.approx(_C.ideal_bubble("zbv", 4, 2, 2))


@pytest.mark.parametrize(("workers", "chunks"), [(2, 4), (3, 7), (4, 8)])
def test_zbv_micro_batches_in_flight_per_worker(make_pipe: Any, workers: int, chunks: int) -> None:
    # Each cell counts forwards whose input gradient has not run, into its worker's tally:
    # the runtime follows the program on the V's workers, within ZB-V's bound.
    stages = 2 * workers
    where = schedules.placement("zbv", stages, workers)
    tallies = [Counter() for _ in range(workers)]  # bench/schedule_memory.py's counters
    layers: list[nn.Module] = []
    for stage in range(stages):
        layers += [nn.Linear(3, 3), Counter(tallies[where[stage]])]
    pipe = make_pipe(nn.Sequential(*layers).double(), [2] * stages, devices=["cpu"] * workers,
                     chunks=chunks, checkpoint="never", schedule="zbv")  # fmt: skip
    x = torch.randn(2 * chunks, 3, dtype=torch.float64)
    pipe.train_step(x, torch.randn_like(x), nn.functional.mse_loss)
    for w, program in enumerate(_C.program("zbv", stages, workers, chunks)):
        now = peak = 0
        for action, _stage, _m in program:
            now += {"forward": 1, "backward_input": -1}.get(action, 0)
            peak = max(peak, now)
        assert tallies[w].now == 0
        assert tallies[w].peak == peak, w
        assert peak <= 2 * workers


def test_ideal_bubbles_are_the_registrys(make_pipe: Any) -> None:
    spans = [TaskSpan("step", "forward", s, 0, 0.0, 1.0, worker=w)
             for s, w in enumerate([0, 1, 1, 0])]  # fmt: skip
    timeline = Timeline(cells=4, microbatches=8, spans=spans, workers=2, schedule="zbv")
    assert timeline.ideal_bubble == pytest.approx(_C.ideal_bubble("zbv", 4, 2, 8))
    assert schedules.ideal_bubble("zero_bubble", 4, 4, 8) == pytest.approx(3 / 27)
    # pipe(x) and its backward on a pipe whose workers run two cells: their fill-drain
    # runs on those workers (round robin: Megatron's (D-1)/(VM+D-1)).
    pipe = make_pipe(_model(4), [1] * 4, devices=["cpu"] * 2, chunks=4, schedule="interleaved")
    pipe.record_timeline()
    pipe(torch.randn(8, 3, dtype=torch.float64)).sum().backward()
    assert pipe.timeline().ideal_bubble == pytest.approx(1 / 9)


def test_recompute_flags_are_read_from_the_schedule() -> None:
    schedule = _C.make_schedule("zbv", 4, 2, 3, "except_last")
    flags = schedules.recomputed(schedule)
    recompute = _C.actions().index("recompute")
    for stage in range(4):
        for m in range(3):
            expected = any(
                t.action == recompute and t.stage == stage and t.microbatch == m
                for t in schedule.tasks
            )
            assert flags[stage][m] == expected
    assert any(map(any, flags)) and not all(map(all, flags))


# -- actions registered at run time ------------------------------------------------------------


def test_an_action_registered_from_python_links_runs_and_is_priced() -> None:
    name = next(_names)
    before = schedules.actions()
    # After the stage's forward, and after the previous stage's own task of this action.
    action = schedules.register_action(
        name, [Need([("forward", 0)]), Need([(name, -1)])], cost="forward"
    )
    assert action == len(before) and schedules.actions()[action] == name  # not frozen
    program = [[("forward", 0, 0), (name, 0, 0)], [("forward", 1, 0), (name, 1, 0)]]
    schedule = _C.link(program, 2, 1)
    schedule.validate()
    assert [t.deps for t in schedule.tasks] == [[], [0], [0], [2, 1]]
    # The simulator prices it by its cost class: as a forward.
    costs = [StageCosts(forward=3.0, backward=7.0)] * 2
    assert task_costs(schedule, costs, 0.5) == [3.5, 3.5, 3.5, 3.5]
    # The executor runs it like any action.
    calls: list[tuple[str, int]] = []
    executor = _C.Executor(2)
    try:
        executor.run(schedule, lambda a, s, m: calls.append((schedules.actions()[a], s)))
    finally:
        executor.close()
    assert calls.index((name, 1)) > calls.index((name, 0))
    assert calls.index((name, 1)) > calls.index(("forward", 1))


def test_a_step_dispatches_a_registered_action_to_its_handler(make_pipe: Any) -> None:
    pipe = make_pipe(_model(2), [1, 1], devices=["cpu"] * 2)
    bare = schedules.register_action(next(_names), [Need([("forward", 0)])])
    pipeline = pipeline_of(pipe)
    step = Step(pipeline, [torch.randn(2, 3, dtype=torch.float64)], [False], [[False]] * 2,
                False, transport=pipeline.make_transport())  # fmt: skip
    with pytest.raises(NotImplementedError, match=f"stage 1 has no handler for action "
                       f"'{schedules.actions()[bare]}'"):  # fmt: skip
        step.handlers[bare][1](0)
    seen: list[tuple[int, int]] = []

    def record(stage: Stage, m: int) -> None:
        seen.append((stage.index, m))

    action = schedules.register_action(next(_names), [Need([("forward", 0)])], handler=record)
    pipeline = pipeline_of(pipe)
    step = Step(pipeline, [torch.randn(2, 3, dtype=torch.float64)], [False], [[False]] * 2,
                False, transport=pipeline.make_transport())  # fmt: skip
    step.run_task(action, 1, 0)
    assert seen == [(1, 0)]
    # A Stage method of the action's name is not what runs it: the handler table is.
    assert not hasattr(Stage, schedules.actions()[action])


def test_a_registered_communication_action_is_left_out_of_the_bubble() -> None:
    name = next(_names)
    schedules.register_action(name, [Need([("forward", 0)], "every")], communication=True)
    assert name in schedules.communication_actions()
    spans = [
        TaskSpan("step", "forward", 0, 0, 0.0, 1.0, worker=0),
        TaskSpan("step", name, 0, 0, 1.0, 2.0, worker=1),
    ]
    assert Timeline(cells=1, microbatches=1, spans=spans, workers=2).compute_rows() == [0]


@pytest.mark.parametrize(
    ("needs", "cost", "match"),
    [
        ([Need([("frobnicate", 0)])], "none", "unknown action 'frobnicate'"),
        ([Need([])], "none", "a need names at least one"),
        ([Need([("forward", 0)], "some")], "none", "'same' or 'every'"),
        ([Need([("forward", 0)])], "cheap", "cost must be"),
    ],
)
def test_bad_registrations_are_refused_and_add_nothing(
    needs: list[Need], cost: str, match: str
) -> None:
    count = len(schedules.actions())
    with pytest.raises(ValueError, match=match):
        schedules.register_action(next(_names), needs, cost=cost)
    with pytest.raises(ValueError, match="snake_case"):
        schedules.register_action("Not-Snake", [Need([("forward", 0)])])
    with pytest.raises(ValueError, match="already registered"):
        schedules.register_action("forward", [Need([("forward", 0)])])
    assert len(schedules.actions()) == count


def test_one_way_actions_come_from_the_wire_facts() -> None:
    from gpipe_fast.schedule.registry import one_way_actions

    sends, receives = one_way_actions("send"), one_way_actions("receive")
    assert {"send_forward", "send_backward", "send_skips", "send_skip_grads"} <= sends
    assert {"recv_forward", "recv_backward", "recv_skips", "recv_skip_grads"} <= receives
    # A reduction both sends and receives; compute neither.
    assert not {"reduce_grad", "forward", "backward_weight"} & (sends | receives)
    with pytest.raises(ValueError, match="direction must be 'send' or 'receive'"):
        one_way_actions("both")

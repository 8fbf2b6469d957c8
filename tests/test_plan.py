"""The plan report: per-cell rows and the simulator's predicted step time and bubble."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.device.host import threads_per_cell
from gpipe_fast.planning.predict import StageCosts, predict, task_costs

from helpers import Sleepy, funnel


@pytest.mark.parametrize("cells", [2, 4])
@pytest.mark.parametrize("chunks", [1, 4, 8])
@pytest.mark.parametrize("cost", ["params", "size"])
def test_plan_bubble_on_equal_layers(cells: int, chunks: int, cost: str) -> None:
    module = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])
    result = gf.plan(module, torch.randn(8, 8), cells, chunks, cost=cost)
    assert result.balance == [8 // cells] * cells
    assert abs(result.bubble - (cells - 1) / (chunks + cells - 1)) < 1e-9
    # A cell costs c; a micro-batch task c / M forward and 2c / M backward; each phase takes
    # M + K - 1 task slots.
    per_cell = result.cells[0].cost
    want = 3 * per_cell * (chunks + cells - 1) / chunks
    assert result.step_time == pytest.approx(want, rel=1e-12)
    assert result.forward_time == pytest.approx(want / 3, rel=1e-12)


def test_plan_rows() -> None:
    module = funnel()
    result = gf.plan(module, torch.randn(8, 16), 3, 4, cost="params")
    assert result.balance == [2, 1, 2] and result.chunks == 4 and result.unit == "params"
    assert [c.layers for c in result.cells] == [range(0, 2), range(2, 3), range(3, 5)]
    assert [c.names for c in result.cells] == [["0", "1"], ["2"], ["3", "4"]]
    assert [c.cost for c in result.cells] == [273 + 4353, 65793, 4113 + 273]
    assert [c.param_bytes for c in result.cells] == [4 * (272 + 4352), 4 * 65792, 4 * 4384]
    # Cell outputs on the mini-batch of 8, per micro-batch of 2: widths 256, 256, 16.
    assert [c.activation_bytes for c in result.cells] == [2 * 256 * 4, 2 * 256 * 4, 2 * 16 * 4]
    text = str(result)
    assert "3 cells" in text and "4 micro-batches" in text and "bubble" in text
    # Title, header, a row per cell, the predicted step, the predicted memory.
    assert len(text.splitlines()) == 1 + 1 + 3 + 1 + 1


def test_plan_uses_given_balance_and_layer_names() -> None:
    module = nn.Sequential()
    for name in ("embed", "body", "head"):
        module.add_module(name, nn.Linear(4, 4))
    result = gf.plan(module, torch.randn(4, 4), 2, 2, balance=[1, 2], cost="params")
    assert result.balance == [1, 2]
    assert [c.names for c in result.cells] == [["embed"], ["body", "head"]]
    assert "body..head" in str(result)


_SEEN: list[tuple[int, int]] = []  # shared by the copies profiling makes of the layer


class _Witness(nn.Module):
    """Identity that records the batch size and intra-op threads it runs with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _SEEN.append((x.size(0), torch.get_num_threads()))
        return x


def test_plan_by_time_profiles_as_the_cells_run() -> None:
    # Each layer is timed on one micro-batch (the largest: 13 rows split in 4 gives 4, 3, 3,
    # 3), with the threads each CPU cell's worker gets, and the caller's threads restored.
    _SEEN.clear()
    module = nn.Sequential(nn.Linear(8, 8), _Witness(), nn.Linear(8, 8), nn.Linear(8, 8))
    before = torch.get_num_threads()
    result = gf.plan(module, torch.randn(13, 8), 2, 4, warmup=1, repeats=2)
    cell_threads = threads_per_cell([torch.device("cpu")] * 2).per_cell
    assert result.threads == cell_threads
    # The timed passes run on a micro-batch (a pass on the whole sample measures output sizes).
    timed = [seen for seen in _SEEN if seen[0] != 13]
    assert timed and {size for size, _ in timed} == {4}
    assert {threads for _, threads in timed} == {cell_threads or before}
    assert torch.get_num_threads() == before
    assert result.overhead > 0  # the runtime's cost per task, measured


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble", "interleaved"])
def test_plan_step_is_the_schedule_simulated_with_its_costs(schedule: str) -> None:
    # The prediction is the schedule of that kind run by the simulator with the measured
    # per-micro-batch costs of each cell plus the overhead on every task.
    module = nn.Sequential(*[Sleepy(2, 1) for _ in range(4)])
    devices = 2 if schedule == "interleaved" else None
    result = gf.plan(module, torch.randn(8, 4), 4, 4, warmup=1, repeats=2, schedule=schedule,
                     devices=devices)  # fmt: skip
    assert result.schedule == schedule and result.balance == [1, 1, 1, 1]
    steps = _C.make_schedule(schedule, 4, devices or 4, 4, "never")
    # Nothing learns: no backward flows; each cell costs its forward.
    costs = [StageCosts(forward=cell.cost, backward=0.0) for cell in result.cells]
    want = predict(steps, costs, result.overhead)
    assert result.step_time == pytest.approx(want.step_time, rel=1e-12)
    assert result.bubble == pytest.approx(want.bubble, rel=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_checkpointed_forward_costs_its_forward_without_a_graph(schedule: str) -> None:
    steps = _C.make_schedule(schedule, 2, 2, 3, "except_last")
    flags = _C.recomputed(steps)  # gpipe: all but the last micro-batch; 1f1b: the last stage's not
    names = _C.actions()
    costs = [StageCosts(3.0, 7.0, loss=0.5, forward_no_grad=1.0)] * 2
    priced = {
        (names[t.action], t.stage, t.microbatch): cost
        for t, cost in zip(steps.tasks, task_costs(steps, costs, 0.0), strict=True)
    }
    assert {cost for (name, *_), cost in priced.items() if name == "forward"} == {1.0, 3.0}
    for k in range(2):
        for m in range(3):
            assert priced["forward", k, m] == (1.0 if flags[k][m] else 3.0)
            assert priced.get(("recompute", k, m)) == (3.0 if flags[k][m] else None)  # graph
            assert priced["backward", k, m] == 7.0
    # Unknown (the planner's profiles): a checkpointed forward costs a forward; or as given.
    plain = task_costs(steps, [StageCosts(3.0, 7.0, loss=0.5)] * 2, 0.0)
    assert plain == task_costs(
        steps, [StageCosts(3.0, 7.0, loss=0.5, forward_no_grad=3.0)] * 2, 0.0
    )
    assert task_costs(steps, costs, 0.0, checkpointed=()) == plain


def test_predict_adds_the_overhead_to_every_task() -> None:
    steps = _C.make_schedule("1f1b", 2, 2, 3, "never")
    costs = [StageCosts(forward=1.0, backward=2.0, loss=0.5)] * 2
    plain = predict(steps, costs)
    # 1F1B on 2 stages, 3 micro-batches: 3 forwards, 3 backwards per stage, losses on the
    # last: (M + K - 1) forward and backward slots on the critical path plus the losses.
    assert plain.step_time == pytest.approx(3 * 3 + 3 * 1 + 3 * 0.5)
    # Every task 0.25 longer (F 1.25, L 0.75, B 2.25), by hand: stage 0 runs F0 [0, 1.25],
    # F1, B0 [5.5, 7.75], F2 [7.75, 9], B1 [9.75, 12] and B2 [14, 16.25], after stage 1's B2.
    assert predict(steps, costs, overhead=0.25).step_time == pytest.approx(16.25)
    with pytest.raises(ValueError, match="costs: got 1 stages"):
        predict(steps, costs[:1])


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_plan_counts_recomputation(checkpoint: str) -> None:
    module = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(8, 8)
    plain = gf.plan(module, x, 2, 4, cost="params")
    recomputing = gf.plan(module, x, 2, 4, cost="params", checkpoint=checkpoint)
    per_cell = plain.cells[0].cost  # equal cells; a Recompute task costs a forward task
    recomputed = 4 if checkpoint == "always" else 3
    assert recomputing.forward_time == pytest.approx(plain.forward_time, rel=1e-12)
    # Cell 1 (first in backward) runs its recomputes in series with its backward tasks.
    assert recomputing.backward_time > plain.backward_time
    extra = recomputing.backward_time - plain.backward_time
    assert extra >= recomputed * per_cell / 4 - 1e-9
    with pytest.raises(ValueError, match="checkpoint"):
        gf.plan(module, x, 2, 4, cost="params", checkpoint="sometimes")


def test_profile_statistic_sums_up_the_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three runs of one Linear, by a scripted clock: forwards of 1 s, 1 s and 10 s (a stall),
    # backwards of 1 s each. The median leaves the stall out, the mean counts it.
    import gpipe_fast.balancing.profile as gp

    def profile(statistic: str) -> gp.LayerProfile:
        reads = iter([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 14, 14, 15])
        monkeypatch.setattr(gp, "_clock", lambda: float(next(reads)))
        return gp.profile_layers(nn.Sequential(nn.Linear(3, 3)), torch.randn(2, 3), warmup=0,
                                 repeats=3, statistic=statistic)  # fmt: skip

    assert profile("median").forward == [1.0] and profile("mean").forward == [4.0]
    assert profile("mean").backward == [1.0]
    with pytest.raises(ValueError, match="statistic must be one of"):
        gf.plan(nn.Sequential(nn.Linear(3, 3)), torch.randn(2, 3), 1, 1, statistic="mode")

"""The plan report: per-cell rows and the simulator's predicted step time and bubble."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpipe_fast as gf

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
    assert len(text.splitlines()) == 1 + 1 + 3 + 1  # title, header, a row per cell, prediction


def test_plan_uses_given_balance_and_layer_names() -> None:
    module = nn.Sequential()
    for name in ("embed", "body", "head"):
        module.add_module(name, nn.Linear(4, 4))
    result = gf.plan(module, torch.randn(4, 4), 2, 2, balance=[1, 2], cost="params")
    assert result.balance == [1, 2]
    assert [c.names for c in result.cells] == [["embed"], ["body", "head"]]
    assert "body..head" in str(result)


def test_plan_by_time() -> None:
    module = nn.Sequential(*[Sleepy(5) for _ in range(4)], Sleepy(30))
    result = gf.plan(module, torch.randn(4, 8), 2, 4, warmup=1, repeats=3)
    assert result.balance == [4, 1] and result.unit == "s"
    # Nothing learns, so there is no backward. The forward is the measured cell times run
    # through the fill-drain schedule: two cells of tasks a = c0 / M and b = c1 / M end
    # after max(a + M b, M a + b), and the cells are busy c0 + c1 of it.
    assert result.backward_time == 0.0
    first, second = (cell.cost for cell in result.cells)
    assert first > 0.0 and second > 0.0
    chunks = result.chunks
    want = max(first / chunks + second, first + second / chunks)
    assert result.forward_time == pytest.approx(want, rel=1e-9)
    assert result.step_time == result.forward_time
    assert result.bubble == pytest.approx(1 - (first + second) / (2 * want), rel=1e-9)


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

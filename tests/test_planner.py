"""planning/planner.py: the layers' profiles, taken in rounds across layer sets and sizes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_fast.balancing.profile import LayerProfile
from gpipe_fast.planning import planner as planning


def _planner(layers: int = 3) -> planning.Planner:
    module = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    return planning.Planner(module, torch.randn(8, 4), 2, "time", None, 2, 1, 3, 2.0, "adamw")


class _Profiles:
    """profile_layers replaced: each call recorded, its times the call's number (so that a
    median over rounds can be told from any one round)."""

    def __init__(self, fail_rows: int) -> None:
        self.calls: list[tuple[int, int, int, bool]] = []  # (rows, warmup, repeats, split)
        self.fail_rows = fail_rows  # the micro-batch rows whose profile raises

    def __call__(self, module: nn.Sequential, sample: torch.Tensor, **kwargs: Any
                 ) -> LayerProfile:  # fmt: skip
        rows = sample.size(0)
        self.calls.append((rows, kwargs["warmup"], kwargs["repeats"], kwargs["split"]))
        if rows == self.fail_rows:
            raise RuntimeError("a layer cannot run on this micro-batch")
        value = float(len(self.calls))
        count = len(module)
        halves = [value / 4] * count if kwargs["split"] else []
        return LayerProfile([value] * count, [2 * value] * count, [0] * count, halves, halves)


@pytest.fixture
def profiles(monkeypatch: pytest.MonkeyPatch) -> _Profiles:
    """profile_layers replaced by a _Profiles that fails on one-row micro-batches."""
    replaced = _Profiles(fail_rows=1)
    monkeypatch.setattr(planning, "profile_layers", replaced)
    return replaced


def test_the_rounds_interleave_the_sizes_and_keep_each_layers_median(profiles: _Profiles) -> None:
    planner = _planner()
    planning.profile_in_rounds([(planner, 2, "gpipe"), (planner, 4, "gpipe")], 3)
    # Every size once a round, the planner's warm-up in the first round only.
    assert profiles.calls == [(4, 1, 1, False), (2, 1, 1, False), (4, 0, 1, False),
                              (2, 0, 1, False), (4, 0, 1, False), (2, 0, 1, False)]  # fmt: skip
    # Two micro-batches (4 rows) were the calls 1, 3 and 5: their median, 3.
    costs = planner.layer_costs(2, "gpipe")
    assert costs.forward == [3.0] * 3 and costs.backward == [6.0] * 3
    assert costs.total == [9.0] * 3 and costs.backward_input == [3.0] * 3
    assert planner.layer_costs(4, "gpipe").forward == [4.0] * 3  # calls 2, 4, 6
    assert len(profiles.calls) == 6  # layer_costs then profiles nothing again


def test_the_rounds_serve_a_split_backward_and_skip_what_is_profiled(profiles: _Profiles) -> None:
    planner = _planner()
    # Two kinds of the same size: one profile, split (zero bubble's halves also hold the
    # whole backward); planners of the same layers (another cell count) share it.
    other = dataclasses.replace(planner, cells=4)
    wanted = [(planner, 2, "zero_bubble"), (other, 2, "interleaved")]
    planning.profile_in_rounds(wanted, 2)
    assert profiles.calls == [(4, 1, 1, True), (4, 0, 1, True)]
    assert planner.layer_costs(2, "zero_bubble").backward_input == [0.375] * 3
    assert other.layer_costs(2, "interleaved").forward == [1.5] * 3
    planning.profile_in_rounds(wanted, 2)
    assert len(profiles.calls) == 2


def test_a_size_that_fails_is_left_to_layer_costs(profiles: _Profiles) -> None:
    planner = _planner()
    planning.profile_in_rounds([(planner, 8, "gpipe"), (planner, 2, "gpipe")], 3)
    # The failing size is not tried again in later rounds; the other is profiled in full.
    assert [rows for rows, *_ in profiles.calls] == [1, 4, 4, 4]
    assert planner.layer_costs(2, "gpipe").forward == [3.0] * 3
    with pytest.raises(RuntimeError, match="cannot run on this micro-batch"):
        planner.layer_costs(8, "gpipe")


def test_a_real_profile_in_rounds_times_every_layer_and_leaves_them_untouched() -> None:
    torch.manual_seed(0)
    planner = _planner(2)
    before = [p.detach().clone() for p in planner.module.parameters()]
    planning.profile_in_rounds([(planner, 2, "zero_bubble"), (planner, 4, "gpipe")], 2)
    for chunks in (2, 4):
        costs = planner.layer_costs(chunks, "zero_bubble" if chunks == 2 else "gpipe")
        assert len(costs.forward) == 2 and all(t > 0 for t in costs.total)
    assert all(p.grad is None for p in planner.module.parameters())
    assert all(torch.equal(p, b) for p, b in zip(planner.module.parameters(), before, strict=True))

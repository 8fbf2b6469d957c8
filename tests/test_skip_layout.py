"""gpipe_fast.skip.layout: which skips cross cells, and a pipe simulated with its trackers."""

from __future__ import annotations

import pytest
import torch
from skip_models import WIDTH, Down, MultiTwin, UNetTwin, Up, multi, unet
from torch import nn

from gpipe_fast.skip import (
    CellSkipTracker,
    Namespace,
    SkipRoute,
    inspect_skip_layout,
    pop,
    skippable,
    stash,
    use_skip_tracker,
)


class Pass(nn.Module):
    def forward(self, x):
        return x


@skippable(stash=["bar"])
class StashBar(nn.Module):
    def forward(self, x):
        yield stash("bar", x)
        return x


@skippable(pop=["bar"])
class PopBar(nn.Module):
    def forward(self, x):
        return x + (yield pop("bar"))


def _policy(partitions: list[nn.Sequential]) -> list[list]:
    layout = inspect_skip_layout(partitions)
    return [list(layout.copy_policy(j)) for j in range(len(partitions))]


def test_no_skippables() -> None:
    layout = inspect_skip_layout([nn.Sequential(Pass()), nn.Sequential(Pass())])
    assert layout.routes == [] and layout.crossing() == [] and layout.inside() == []
    assert [layout.sends(j) for j in range(2)] == [[], []]
    assert _policy([nn.Sequential(Pass()), nn.Sequential(Pass())]) == [[], []]


def test_inside_one_cell() -> None:
    layout = inspect_skip_layout([nn.Sequential(Down(), Up()), nn.Sequential(Pass())])
    assert layout.inside() == [SkipRoute(None, "down", 0, 0)]
    assert layout.crossing() == []
    assert layout.sends(0) == [] and layout.receives(0) == []
    assert not layout.requires_copy(None, "down")
    assert list(layout.copy_policy(0)) == list(layout.copy_policy(1)) == []


def test_adjoining_cells() -> None:
    layout = inspect_skip_layout([nn.Sequential(Down()), nn.Sequential(Up())])
    route = SkipRoute(None, "down", 0, 1)
    assert layout.crossing() == [route] and route.crosses and route.key == (None, "down")
    assert layout.sends(0) == [(None, "down")] and layout.receives(0) == []
    assert layout.sends(1) == [] and layout.receives(1) == [(None, "down")]
    assert layout.requires_copy(None, "down")
    assert layout.route(None, "down") == route and layout.route(None, "nope") is None
    assert list(layout.copy_policy(1)) == [(0, None, "down")]


def test_far_cells_pass_through_the_middle() -> None:
    parts = [nn.Sequential(Down()), nn.Sequential(Pass()), nn.Sequential(Up())]
    layout = inspect_skip_layout(parts)
    assert layout.sends(0) == [(None, "down")]
    assert layout.passes(1) == [(None, "down")] and layout.passes(0) == layout.passes(2) == []
    assert layout.receives(1) == [] and layout.receives(2) == [(None, "down")]
    assert _policy(parts) == [
        [],
        [],
        [(0, None, "down")],
    ]


def test_receives_sorted_by_stash_cell() -> None:
    parts = [nn.Sequential(Down()), nn.Sequential(StashBar()), nn.Sequential(PopBar(), Up())]
    layout = inspect_skip_layout(parts)
    assert layout.receives(2) == [(None, "down"), (None, "bar")]
    assert list(layout.copy_policy(2)) == [(0, None, "down"), (1, None, "bar")]


def test_namespaces_and_the_default_mixed() -> None:
    ns1, ns2 = Namespace(), Namespace()
    parts = [
        nn.Sequential(Down().isolate(ns1), Down()),
        nn.Sequential(Down().isolate(ns2)),
        nn.Sequential(Up().isolate(ns2), Up(), Up().isolate(ns1)),
    ]
    layout = inspect_skip_layout(parts)
    assert layout.sends(0) == [(ns1, "down"), (None, "down")]
    assert layout.receives(2) == [(ns1, "down"), (None, "down"), (ns2, "down")]
    assert list(layout.copy_policy(2)) == [(0, ns1, "down"), (0, None, "down"), (1, ns2, "down")]


def test_pairs_group_the_crossing_skips_by_their_cells() -> None:
    ns1, ns2 = Namespace(), Namespace()
    parts = [
        nn.Sequential(Down().isolate(ns1), Down(), StashBar()),
        nn.Sequential(Down().isolate(ns2), PopBar()),
        nn.Sequential(Up().isolate(ns2), Up(), Up().isolate(ns1)),
    ]
    layout = inspect_skip_layout(parts)
    assert layout.pairs() == {
        (0, 2): [(ns1, "down"), (None, "down")],
        (0, 1): [(None, "bar")],
        (1, 2): [(ns2, "down")],
    }


def test_mixed_inside_and_crossing() -> None:
    layout = inspect_skip_layout([nn.Sequential(StashBar(), Down(), PopBar()), nn.Sequential(Up())])
    assert layout.inside() == [SkipRoute(None, "bar", 0, 0)]
    assert layout.crossing() == [SkipRoute(None, "down", 0, 1)]


def test_pop_without_stash() -> None:
    with pytest.raises(TypeError, match="cell 1 pops 'down' but no earlier layer stashes it"):
        inspect_skip_layout([nn.Sequential(Pass()), nn.Sequential(Up()), nn.Sequential(Down())])


def test_stash_without_pop_has_no_route() -> None:
    assert inspect_skip_layout([nn.Sequential(Down())]).routes == []


def _simulate_pipe(model: nn.Sequential, balance: list[int], x: torch.Tensor) -> torch.Tensor:
    """Runs model cut into cells, each under its own CellSkipTracker, carrying skips
    between cells as a runtime would: outgoing of cell k to the cells that receive them."""
    cells, start = [], 0
    for size in balance:
        cells.append(nn.Sequential(*list(model)[start : start + size]))
        start += size
    layout = inspect_skip_layout(cells)
    in_flight: dict = {}
    for k, cell in enumerate(cells):
        received = {key: in_flight.pop(key) for key in layout.receives(k)}
        tracker = CellSkipTracker(layout, k, received)
        with use_skip_tracker(tracker):
            x = cell(x)
        assert set(tracker.outgoing) == set(layout.sends(k))
        assert tracker.received == {} and tracker.tensors == {}
        in_flight.update(tracker.outgoing)
        # What is in flight after cell k is what the next cell relays or pops.
        if k + 1 < len(cells):
            assert set(in_flight) == set(layout.passes(k + 1) + layout.receives(k + 1))
    assert in_flight == {}
    return x


@pytest.mark.parametrize("balance", [[5], [1, 4], [2, 1, 2], [1, 1, 1, 1, 1], [4, 1]])
def test_cells_with_cell_trackers_match_the_twin(balance: list[int]) -> None:
    model = unet(2).double()
    twin = UNetTwin(model, 2)
    x = torch.randn(3, WIDTH, dtype=torch.float64, requires_grad=True)
    out = _simulate_pipe(model, balance, x)
    (out**2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    x_grad = x.grad.clone()
    model.zero_grad()
    x.grad = None
    expected = twin(x)
    (expected**2).sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_grad, rtol=0, atol=0)
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)


@pytest.mark.parametrize("balance", [[2, 3], [1, 2, 2], [3, 2]])
def test_several_skips_across_cells(balance: list[int]) -> None:
    model = multi().double()
    x = torch.randn(2, WIDTH, dtype=torch.float64)
    torch.testing.assert_close(_simulate_pipe(model, balance, x), MultiTwin(model)(x))


def test_recomputation_under_a_fresh_tracker_with_the_same_received() -> None:
    cells = [nn.Sequential(Down()), nn.Sequential(StashBar(), PopBar(), Up())]
    layout = inspect_skip_layout(cells)
    x = torch.randn(2, WIDTH)
    first = CellSkipTracker(layout, 0)
    with use_skip_tracker(first):
        h = cells[0](x)
    runs = []
    for _ in range(2):  # the forward, then its recomputation
        tracker = CellSkipTracker(layout, 1, first.outgoing)
        with use_skip_tracker(tracker):
            runs.append(cells[1](h))
    torch.testing.assert_close(runs[0], runs[1])
    assert (None, "down") in first.outgoing  # received was copied, not consumed

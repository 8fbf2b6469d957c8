"""gpipe_fast.skip.tracker: the per-thread tracker and its two hooks, save and load."""

from __future__ import annotations

import threading
from queue import Queue

import pytest
import torch
from skip_models import WIDTH, Down, Up
from torch import nn

from gpipe_fast.skip import Namespace, pop, skippable, stash
from gpipe_fast.skip.tracker import SkipTracker, current_skip_tracker, use_skip_tracker


class Recording(SkipTracker):
    """A tracker that logs every hook call, as a runtime's tracker would see them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def save(self, ns, name, tensor):
        self.calls.append(("save", ns, name, tensor))
        super().save(ns, name, tensor)

    def load(self, ns, name):
        self.calls.append(("load", ns, name))
        return super().load(ns, name)


def test_default_tracker_per_thread() -> None:
    mine = current_skip_tracker()
    assert type(mine) is SkipTracker
    assert current_skip_tracker() is mine
    q: Queue = Queue()
    thread = threading.Thread(target=lambda: q.put(current_skip_tracker()))
    thread.start()
    thread.join()
    other = q.get()
    assert type(other) is SkipTracker and other is not mine


def test_use_skip_tracker_nests_and_restores() -> None:
    outer, inner = SkipTracker(), SkipTracker()
    before = current_skip_tracker()
    with use_skip_tracker(outer) as got:
        assert got is outer and current_skip_tracker() is outer
        with use_skip_tracker(inner):
            assert current_skip_tracker() is inner
        assert current_skip_tracker() is outer
    assert current_skip_tracker() is before


def test_use_skip_tracker_restores_after_an_error() -> None:
    before = current_skip_tracker()
    with pytest.raises(ValueError), use_skip_tracker(SkipTracker()):
        raise ValueError
    assert current_skip_tracker() is before


def test_use_skip_tracker_is_thread_local() -> None:
    seen: list[SkipTracker] = []
    mine = SkipTracker()
    with use_skip_tracker(mine):
        thread = threading.Thread(target=lambda: seen.append(current_skip_tracker()))
        thread.start()
        thread.join()
    assert seen[0] is not mine


def test_hooks_called_with_namespace_name_and_the_tensor() -> None:
    ns = Namespace()
    tracker = Recording()
    x = torch.randn(1, WIDTH)
    with use_skip_tracker(tracker):
        nn.Sequential(Down().isolate(ns), Up().isolate(ns))(x)
    assert [c[:3] for c in tracker.calls] == [("save", ns, "down"), ("load", ns, "down")]
    assert tracker.calls[0][3] is x
    assert tracker.tensors == {}


def test_save_after_the_forward_and_in_name_order() -> None:
    tracker = Recording()

    @skippable(stash=["b", "a"], pop=["down"])
    class Layer(nn.Module):
        def forward(self, x):
            yield stash("b", x)
            skip = yield pop("down")
            tracker.calls.append(("body returns",))
            yield stash("a", skip)
            return x

    with use_skip_tracker(tracker):
        nn.Sequential(Down(), Layer())(torch.ones(1, WIDTH))
    assert [c[:3] for c in tracker.calls] == [
        ("save", None, "down"),
        ("load", None, "down"),
        ("body returns",),
        ("save", None, "a"),
        ("save", None, "b"),
    ]


def test_a_tracker_supplies_pops_and_collects_stashes() -> None:
    # What a pipe runtime does for a cell: feed in a skip from an earlier cell,
    # take out a skip for a later one.
    class Feeding(SkipTracker):
        def __init__(self, given):
            super().__init__()
            self.given = given
            self.taken = {}

        def load(self, ns, name):
            return self.given[(ns, name)]

        def save(self, ns, name, tensor):
            self.taken[(ns, name)] = tensor

    skip = torch.randn(1, WIDTH)
    tracker = Feeding({(None, "down"): skip})
    up, down = Up(), Down()
    x = torch.randn(1, WIDTH)
    with use_skip_tracker(tracker):
        out = nn.Sequential(up, down)(x)
    y = up.lin(x) + up.scale * skip
    torch.testing.assert_close(out, torch.tanh(down.lin(y)))
    torch.testing.assert_close(tracker.taken[(None, "down")], y)


def test_load_key_error_becomes_not_stashed() -> None:
    with use_skip_tracker(SkipTracker()), pytest.raises(RuntimeError, match="not been stashed"):
        Up()(torch.ones(1, WIDTH))


def test_unpopped_stash_replaced_by_the_next() -> None:
    tracker = SkipTracker()
    with use_skip_tracker(tracker):
        first, second = torch.ones(1, WIDTH), torch.zeros(1, WIDTH)
        Down()(first)
        Down()(second)
    assert len(tracker.tensors) == 1
    assert tracker.tensors[(None, "down")] is second


def test_a_cut_cell_tracker_tells_each_layers_skips() -> None:
    # What the zero-bubble schedules run: each layer's popped leaves and stashed tensors
    # are extra inputs and outputs of its piece of graph, inside the cell too.
    from gpipe_fast.skip import CellSkipTracker, inspect_skip_layout

    ns_in, ns_out = Namespace(), Namespace()
    cells = [
        [Down().isolate(ns_in), Up().isolate(ns_in), Down().isolate(ns_out)],
        [Up().isolate(ns_out)],
    ]
    layout = inspect_skip_layout(cells)
    x = torch.randn(2, WIDTH, requires_grad=True)
    tracker = CellSkipTracker(layout, 0, cut=True)
    taken = []
    with use_skip_tracker(tracker):
        y = x
        for layer in cells[0]:
            y = layer(y)
            taken.append(tracker.take_layer())
    (_, stashed0), (popped1, _), (_, stashed2) = taken
    assert [key for key, _ in stashed0] == [(ns_in, "down")] and stashed0[0][1] is x
    # The pop inside the cell gets a leaf of the stash, cut from its graph.
    assert [key for key, _ in popped1] == [(ns_in, "down")]
    leaf = popped1[0][1]
    assert leaf is not x and leaf.grad_fn is None and leaf.requires_grad
    assert [key for key, _ in stashed2] == [(ns_out, "down")]
    assert tracker.outgoing[(ns_out, "down")] is stashed2[0][1]
    # The cell that pops it gets what was received, and tells it as the layer's pop.
    received = stashed2[0][1].detach().requires_grad_()
    popping = CellSkipTracker(layout, 1, {(ns_out, "down"): received}, cut=True)
    with use_skip_tracker(popping):
        cells[1][0](torch.randn(2, WIDTH))
    assert popping.take_layer() == ([((ns_out, "down"), received)], [])

"""capture/discover.py and capture/routes.py: the routes the planner finds for small forwards,
each value by what makes it, and what it refuses at build time, naming where."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gpipe_fast.capture.discover import discover
from gpipe_fast.capture.plan import CapturePlan, Route


def _crossing(plan: CapturePlan) -> list[Route]:
    return [r for r in plan.routes.values() if r.value >= 0]


class _Glue(nn.Module):
    """A value made by glue ops between two stages' modules."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h = h * 2 + 1
        return self.b(h)


def test_a_value_made_between_modules_is_taken_where_glue_makes_it() -> None:
    plan = discover(_Glue(), torch.randn(2, 4), ["b"])
    (route,) = _crossing(plan)
    value = plan.values[route.value]
    assert (route.producer, route.consumers, route.floating) == (0, [1], True)
    assert (
        value.kind == "op"
        and "the output of add" in value.what
        and "after 'a' (call 0)" in value.what
    )
    assert plan.atoms == [["a"], ["b"]]
    # The model's input reaches every other stage, which runs the forward on it too.
    assert plan.routes["input:0"].consumers == [1] and plan.tensor_inputs == ["0"]


class _Fan(nn.Module):
    """A's output read by the next stage's module and by the glue of the stage after."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        g = self.b(h)
        return self.c(g + h)


def test_a_value_read_by_two_later_stages_has_one_route_to_both() -> None:
    plan = discover(_Fan(), torch.randn(2, 4), ["b", "c"])
    routes = {plan.values[r.value].what: r for r in _crossing(plan)}
    assert set(routes) == {"output 0 of 'a' (call 0)", "output 0 of 'b' (call 1)"}
    assert routes["output 0 of 'a' (call 0)"].consumers == [1, 2]  # b's input; g + h on stage 2
    assert routes["output 0 of 'b' (call 1)"].consumers == [2]
    assert all(plan.values[r.value].kind == "out" for r in routes.values())


class _OwnTensors(nn.Module):
    """Glue with a parameter and a buffer of its own: the scale read on both stages."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.full((4,), 2.0))
        self.register_buffer("shift", torch.ones(4))
        self.register_buffer("unused", torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x) * self.scale) * self.scale + self.shift


def test_the_glues_own_tensors_go_with_the_stages_that_read_them() -> None:
    plan = discover(_OwnTensors(), torch.randn(2, 4), ["b"])
    assert plan.reads == [["scale"], ["scale", "shift"]]
    (route,) = _crossing(plan)  # a(x) * scale: made on stage 0 before b is called
    assert plan.values[route.value].kind == "op"


class _Constants(nn.Module):
    """Tensors the glue makes from nothing, and inputs that are no tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor, scale: float = 1.0, bias: bool = True) -> Tensor:
        mask = torch.ones(x.shape[0], 1, dtype=x.dtype)  # on every stage alike
        h = self.a(x) * scale
        return self.b(h * mask) + (mask if bias else 0)


def test_constants_and_tensors_made_from_nothing_cross_no_stage() -> None:
    plan = discover(_Constants(), {"x": torch.randn(2, 4), "scale": 0.5, "bias": True}, ["b"])
    assert plan.constant_inputs == {"scale": 0.5, "bias": True}
    (route,) = _crossing(plan)  # only (a(x) * scale) * mask, which stage 0 makes
    assert plan.values[route.value].stages == frozenset({0})


class _WritesInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h.mul_(2)
        return self.b(h)


def test_a_value_written_in_place_across_stages_is_refused() -> None:
    with pytest.raises(ValueError, match=r"mul_ after 'a' \(call 0\).*writes it in place"):
        discover(_WritesInPlace(), torch.randn(2, 4), ["b"])
    discover(_WritesInPlace(), torch.randn(2, 4), [])  # within one stage it is the model's own


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if x.abs().mean().item() > 0:  # a value read inside this module
            x = x * 2
        return self.lin(x)


class _ReadsInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.inner, self.b = nn.Linear(4, 4), _Inner(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.inner(self.a(x)))


def test_a_value_read_on_the_host_is_refused_naming_the_module_it_is_read_in() -> None:
    with pytest.raises(ValueError, match=r"on the host inside 'inner' \(aten"):
        discover(_ReadsInside(), torch.randn(2, 4), ["b"])


class _CalledTwice(nn.Module):
    """`pair` spans the split point once, then runs whole inside the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.pair(self.head(self.pair(x)))


def test_a_module_called_across_a_split_and_within_a_stage_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'pair' is called both within one stage and across"):
        discover(_CalledTwice(), torch.randn(2, 4), ["pair.1"])


class _Shared(nn.Module):
    """One module called by two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.middle = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.shared(self.middle(self.shared(x)))


def test_a_module_called_by_two_stages_is_held_by_each() -> None:
    plan = discover(_Shared(), torch.randn(2, 4), ["middle"])
    assert plan.atoms == [["shared"], ["shared", "middle"]]


def test_bad_split_points_are_refused_at_build() -> None:
    with pytest.raises(ValueError, match="names no module"):
        discover(_Glue(), torch.randn(2, 4), ["c"])
    with pytest.raises(ValueError, match="stage 0 would run no module of its own"):
        discover(_Glue(), torch.randn(2, 4), ["a"])
    with pytest.raises(ValueError, match="each called after the one before"):
        discover(_Fan(), torch.randn(2, 4), ["c", "b"])

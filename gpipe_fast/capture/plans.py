"""A model's plans by mode (training, evaluation), each made when first needed.

The forward in training and in evaluation mode is not the same program (dropout returns its
input as it is in evaluation), so each mode has its plan, its routes named as the first plan's
(the stages' wire and skips)."""

from __future__ import annotations

import threading
from typing import Any

from torch import nn

from gpipe_fast.capture.discover import discover
from gpipe_fast.capture.plan import CapturePlan


class CapturePlans:
    """The plan of each mode of `model` cut at `split_points`, planned on `example`."""

    def __init__(self, model: nn.Module, example: Any, split_points: list[str], first: CapturePlan):
        self.first = first
        self._model = model
        self._example = example
        self._split_points = list(split_points)
        self._plans = {first.training: first}
        self._lock = threading.Lock()

    def all(self) -> list[CapturePlan]:
        return list(self._plans.values())

    def get(self, training: bool) -> CapturePlan:
        plan = self._plans.get(training)
        if plan is None:
            with self._lock:
                plan = self._plans.get(training)
                if plan is None:
                    made = discover(self._model, self._example, self._split_points, training)
                    plan = self._plans[training] = _named_as(self.first, made)
        return plan


def _mode(training: bool) -> str:
    return "training" if training else "evaluation"


def _named_as(first: CapturePlan, other: CapturePlan) -> CapturePlan:
    """`other` with its routes named as `first`'s: the same values cross, in the same order
    and between the same stages, whatever ops make them in each mode."""

    def signature(plan: CapturePlan) -> list[tuple[int, tuple[int, ...], bool]]:
        return [(r.producer, tuple(sorted(r.consumers)), r.floating)
                for r in plan.routes.values() if r.value >= 0]  # fmt: skip

    if signature(first) != signature(other):
        raise ValueError(
            f"gpipe_fast.pipeline: in {_mode(other.training)} mode the model's forward passes "
            f"other values between stages than in {_mode(first.training)} mode, in which the "
            f"pipe was built ({_listed(other)}, against {_listed(first)}); build the pipe in "
            "the mode it runs in, or move the split points"
        )
    names = [r.key for r in first.routes.values() if r.value >= 0]
    routes = [r for r in other.routes.values() if r.value >= 0]
    for name, route in zip(names, routes, strict=True):
        route.key = name
    inputs = {k: r for k, r in other.routes.items() if r.value < 0}
    other.routes = {r.key: r for r in routes} | inputs
    return other


def _listed(plan: CapturePlan) -> str:
    crossing = [f"{r.what} from stage {r.producer}" for r in plan.routes.values() if r.value >= 0]
    return "; ".join(crossing) or "none"

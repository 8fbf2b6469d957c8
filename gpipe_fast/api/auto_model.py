"""gf.pipeline's side of "auto": the same model cut at other split points, for the tuner."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

from torch import nn

from gpipe_fast.api.auto import Cut, GPipe, rebuilt, worker_devices
from gpipe_fast.api.gpipe import GPipe as Pipe
from gpipe_fast.balancing.balance import partition
from gpipe_fast.capture.cell import captured_cells
from gpipe_fast.capture.discover import discover, repeated_blocks
from gpipe_fast.capture.plans import CapturePlans
from gpipe_fast.capture.split import SPLIT_BY, choose_split_points
from gpipe_fast.nn.microbatch import Value


class ModelBuilder:
    """Pipes of one model (gf.pipeline's ModelPipe) cut at the split points chosen by each
    of gf.pipeline's ways (split_by), the other arguments as given. Across processes its
    split points stay: a stage's modules are the model's own, and moving them between ranks
    is not done yet."""

    moves_layers = False
    profiles_copies = False

    def __init__(self, model: nn.Module, example_inputs: Any, arguments: dict[str, Any],
                 pipe: GPipe) -> None:  # fmt: skip
        self.pipe_class = type(pipe)
        self.tuned = weakref.ref(pipe)  # whose stage 0 knows which inputs a step's tuple holds
        self.model = model
        self.example_inputs = example_inputs
        self.arguments = dict(arguments)
        for name in ("schedule", "chunks", "checkpoint"):
            self.arguments.pop(name, None)
        if self.arguments.get("devices") is None and not pipe.layout.multi_process:
            self.arguments["devices"] = worker_devices(pipe)
        self._plans: dict[tuple[str, ...], CapturePlans] = {tuple(pipe.split_points): pipe._plans}
        self._cuts: dict[int, list[tuple[str, ...]]] = {}

    def plan(self, split_points: tuple[str, ...]) -> CapturePlans:
        if split_points not in self._plans:
            first = discover(self.model, self.example_inputs, list(split_points))
            self._plans[split_points] = CapturePlans(self.model, self.example_inputs,
                                              list(split_points), first)  # fmt: skip
        return self._plans[split_points]

    def build(self, cut: Cut) -> GPipe:
        points = cut.split_points or ()
        return self.pipe_class(self.model, self.plan(points), list(points),
                               schedule=cut.schedule, **self.arguments)  # fmt: skip

    def rebuild(self, pipe: GPipe, cut: Cut) -> None:
        points = cut.split_points or ()
        plan = self.plan(points)
        init = self.pipe_class.__init__
        present = list(pipe._first_stage.present)  # the inputs of the step being tuned for
        rebuilt(pipe, lambda: init(pipe, self.model, plan, list(points),
                                   schedule=cut.schedule, **self.arguments))  # fmt: skip
        pipe._first_stage.present = present

    def cells_of(self, cut: Cut, pipe: GPipe) -> nn.Sequential:
        """The stages of `cut` as layers (stage 0 mapping the step's tuple of inputs as the
        tuned pipe's does)."""
        cells = captured_cells(self.model, self.plan(cut.split_points or ()))
        first: Any = cells[0]
        first.present = list(pipe._first_stage.present)
        return nn.Sequential(OrderedDict((f"stage{k}", c) for k, c in enumerate(cells)))

    def cuts(self, cells: int) -> list[tuple[str, ...]] | None:
        if cells not in self._cuts:
            found: list[tuple[str, ...]] = []
            for way in SPLIT_BY:
                try:
                    points = tuple(choose_split_points(self.model, self.example_inputs, cells,
                                                       partition, way))  # fmt: skip
                except ValueError:  # fewer repeated blocks than cells
                    continue
                if points not in found:
                    found.append(points)
            self._cuts[cells] = found
        return self._cuts[cells]

    def most_cells(self) -> int:
        return max(1, len(repeated_blocks(self.model)))

    def step(self, pipe: GPipe, input: Value | None, target: Any, loss_fn: Any,
             reduction: str) -> Any:  # fmt: skip
        # The input is already the pipe's tuple of tensors: GPipe's own step, past the
        # model's conversion, with stage 0 told which inputs the tuple holds.
        tuned = self.tuned()
        if tuned is not None and tuned is not pipe:
            pipe._first_stage.present = list(tuned._first_stage.present)
        return Pipe.train_step(pipe, input, target, loss_fn, reduction=reduction)  # type: ignore[arg-type]

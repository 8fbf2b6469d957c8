"""One mini-batch in flight: its micro-batches, per-step settings, and its stages' tasks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gpipe_fast.nn.cell import AutocastState
from gpipe_fast.nn.microbatch import Value, as_tensors
from gpipe_fast.nn.randomness import draw_step_seed
from gpipe_fast.runtime.stage import Stage
from gpipe_fast.schedule.registry import actions
from gpipe_fast.transport.local import ACTIVATION, GRADIENT

if TYPE_CHECKING:
    from gpipe_fast.runtime.pipeline import Pipeline

LossFn = Callable[[Any, Any], Tensor]


def annotate(
    error: BaseException, stage: int, microbatch: int, action: str, *, copying: bool
) -> None:
    """Names the cell (stage), micro-batch and action (or the boundary copy into the cell) in
    the error's message, keeping its type."""
    what = f"boundary copy ({action})" if copying else f"{action} pass"
    where = f"gpipe_fast: in cell {stage}, micro-batch {microbatch}, {what}"
    if (
        error.args
        and isinstance(error.args[0], str)
        and not error.args[0].startswith("gpipe_fast:")
    ):
        error.args = (f"{where}: {error.args[0]}", *error.args[1:])
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(where)


def _missing_action(name: str, stage: int) -> Callable[[int], None]:
    def run(microbatch: int) -> None:
        raise NotImplementedError(f"stage {stage} has no method for action {name!r}")

    return run


def _method(stage: Stage | None, name: str, index: int) -> Callable[[int], None]:
    """The stage's method for action `name` (an attribute that is not callable is none)."""
    method = getattr(stage, name, None)
    return method if callable(method) else _missing_action(name, index)


class StepContext:
    """What a step's stages share: its settings, its transport, and what comes back out (the
    losses, the input's gradient). It holds no stage, so that a step's objects form no
    reference cycle and go as soon as the step's output is dropped."""

    def __init__(
        self,
        pipeline: Pipeline,
        count: int,
        input_needs_grad: Sequence[bool],
        checkpointed: Sequence[Sequence[bool]],
        track: bool,
        split: bool,
    ) -> None:
        self.pipeline = pipeline
        self.count = count
        self.input_needs_grad = list(input_needs_grad)
        self.checkpointed = checkpointed
        self.track = track
        self.split = split
        self.seed = draw_step_seed() if pipeline.may_draw_random() else 0
        self.autocast = AutocastState.capture()
        self.transport = pipeline.make_transport()
        # Whether the input of stage k can need a gradient: something before it learns.
        upstream = any(input_needs_grad)
        self.needs_input_grad = []
        for learns in pipeline.learns:
            self.needs_input_grad.append(upstream)
            upstream = upstream or (track and learns)
        self.input_grads: list[Any] = [None] * count
        # Filled by train_step: the loss function, targets per micro-batch, their weights.
        self.loss_fn: LossFn | None = None
        self.targets: list[Any] = []
        self.loss_weights: list[float] = []
        self.losses: list[Tensor | None] = [None] * count

    def input_grad_flags(self, stage: int, tensors: Sequence[Tensor]) -> list[bool]:
        if stage == 0:
            return self.input_needs_grad
        needs = self.needs_input_grad[stage]
        return [needs and t.is_floating_point() for t in tensors]

    def target(self, stage: int, m: int) -> Any:
        """Micro-batch m's target on `stage`'s device."""
        device = self.pipeline.devices[stage]
        target = self.targets[m]
        if isinstance(target, Tensor) and target.is_cpu and device.type == "cpu":
            return target  # the common CPU case, on every loss task
        with self.pipeline.streams.on(stage):
            if isinstance(target, Tensor):
                return target.to(device, non_blocking=True)
            if isinstance(target, tuple):
                return tuple(
                    t.to(device, non_blocking=True) if isinstance(t, Tensor) else t for t in target
                )
            return target


class Step:
    """A mini-batch between its first and last task. `checkpointed[k][m]`: stage k drops
    micro-batch m's activations in forward and recomputes them; `split`: backward runs as
    input and weight halves (zero bubble); `track`: a graph is recorded for backward."""

    def __init__(
        self,
        pipeline: Pipeline,
        microbatches: Sequence[Value],
        input_needs_grad: Sequence[bool],
        checkpointed: Sequence[Sequence[bool]],
        track: bool,
        *,
        count: int | None = None,
        split: bool = False,
    ) -> None:
        """`microbatches`: the input's, when this process runs cell 0 (else empty, and
        `count` says how many there are)."""
        self.pipeline = pipeline
        self.count = len(microbatches) if count is None else count
        self.first_input = microbatches[0] if microbatches else None
        self.track = track
        self.checkpointed = checkpointed
        self.context = StepContext(
            pipeline, self.count, input_needs_grad, checkpointed, track, split
        )
        cells = pipeline.cells
        # One Stage per cell of this process (None: a cell of another process).
        self.stages = [
            None if cell is None else Stage(cell, self.context, last=k == len(cells) - 1)
            for k, cell in enumerate(cells)
        ]
        # The dispatch table: handlers[action id][stage] is that stage's method for it, for
        # every action registered now (more may be registered between steps).
        self.action_names = actions()
        self.handlers = [
            [_method(stage, name, k) for k, stage in enumerate(self.stages)]
            for name in self.action_names
        ]
        self.backward_done = False
        self.gathered: tuple[Tensor, ...] = ()
        self.exit_grads: Any = None
        # Recording: phase -> (schedule, the executor's spans of its run); None when off.
        self.spans: dict[str, tuple[Any, list[tuple[int, int, int]]]] | None = (
            {} if pipeline.recording else None
        )
        for m, value in enumerate(microbatches):
            self.context.transport.deliver(ACTIVATION, 0, m, value)

    @property
    def input_needs_grad(self) -> list[bool]:
        return self.context.input_needs_grad

    def last_stage(self) -> Stage:
        """The last cell's stage (pipe(x) runs every cell in this process)."""
        last = self.stages[-1]
        assert last is not None, "the last cell runs in another process"
        return last

    # -- the executor's callback: runs on the stage's worker thread ------------------------

    def run_task(self, action: int, stage: int, microbatch: int) -> None:
        try:
            self.handlers[action][stage](microbatch)
        except BaseException as error:
            owner = self.stages[stage]
            copying = owner is not None and owner.copying
            annotate(error, stage, microbatch, self.action_names[action], copying=copying)
            if owner is not None:
                owner.copying = False
            self.pipeline.task_failed(error)
            raise

    # -- phases: on the caller's thread ----------------------------------------------------

    def forward(self) -> list[Value]:
        """The fill-drain forward of pipe(x); the last stage's outputs."""
        pipeline = self.pipeline
        schedule = pipeline.schedules.forward(self.count)
        # Every micro-batch is a slice of the same input tensors: one is enough for devices.
        pipeline.streams.cell_waits_caller(0, as_tensors(self.first_input, "input"))
        pipeline.execute(schedule, self, "forward")
        last = self.last_stage()
        outputs = list(last.outputs)
        if not self.track:
            last.outputs = [None] * self.count
        pipeline.streams.join_caller(pipeline.devices[-1])
        return outputs  # type: ignore[return-value]

    def check_backward_once(self) -> None:
        if self.backward_done:
            raise RuntimeError(
                "gpipe_fast: backward through the same pipe output twice is not supported "
                "(its activations are freed as the backward goes); run the pipe again instead"
            )

    def backward(self, grads: list[tuple[Tensor | None, ...]]) -> list[Any]:
        """The fill-drain backward of loss.backward(); the input's gradient per micro-batch."""
        self.check_backward_once()
        self.backward_done = True
        pipeline = self.pipeline
        last = len(self.stages) - 1
        for m, grad in enumerate(grads):
            self.context.transport.deliver(GRADIENT, last, m, grad)
        flags = tuple(self.checkpointed[0])  # the phase path checkpoints alike on every stage
        schedule = pipeline.schedules.backward(flags)
        pipeline.streams.cells_wait_caller()
        pipeline.execute(schedule, self, "backward")
        pipeline.streams.join_caller(pipeline.devices[0])
        pipeline.after_backward()
        return self.context.input_grads

    def train(self, schedule: Any) -> Tensor:
        """Every task of a training step (forward, loss, backward), or of an evaluation's
        forward-only run, in one run of `schedule`; the step's loss (None where this process
        computed none)."""
        pipeline = self.pipeline
        if self.first_input is not None:
            pipeline.streams.cell_waits_caller(0, as_tensors(self.first_input, "input"))
        expect = getattr(self.context.transport, "expect", None)
        if expect is not None:  # across processes: every receive's header, posted ahead
            flows = {"recv_forward": ACTIVATION, "recv_backward": GRADIENT}
            expect([
                (flows[self.action_names[t.action]], t.stage, t.microbatch)
                for t in schedule.tasks
                if self.action_names[t.action] in flows
            ])  # fmt: skip
        pipeline.execute(schedule, self, "step")
        for device in {pipeline.devices[k] for k, stage in enumerate(self.stages) if stage}:
            pipeline.streams.join_caller(device)
        losses = [loss for loss in self.context.losses if loss is not None]
        if not losses:
            return None  # type: ignore[return-value]  # the last cell runs in another process
        return torch.stack(losses).sum() if len(losses) > 1 else losses[0]

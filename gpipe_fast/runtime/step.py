"""One mini-batch in flight: its stages, per-step state, and the dispatch of its tasks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from torch import Tensor

from gpipe_fast.errors import PeerFailure
from gpipe_fast.nn.microbatch import Value
from gpipe_fast.runtime import actions as _builtin_handlers  # noqa: F401  (registers them)
from gpipe_fast.runtime.cell import Cell
from gpipe_fast.runtime.context import LossFn, StageServices, StepContext
from gpipe_fast.runtime.stage import Stage
from gpipe_fast.schedule.registry import action_handler, actions
from gpipe_fast.transport.protocol import ACTIVATION, Transport

__all__ = ["LossFn", "Step", "StepOwner", "annotate"]


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
        raise NotImplementedError(
            f"stage {stage} has no handler for action {name!r} "
            "(register_action(..., handler=...) gives it one)"
        )

    return run


# The actions that run a sharded cell's layers (and so its FSDP collectives).
SHARDED_ACTIONS = frozenset(
    {"forward", "recompute", "backward", "backward_input", "backward_weight"}
)


def _method(stage: Stage | None, name: str, index: int) -> Callable[[int], None]:
    """The stage's task of action `name`: the action's registered handler bound to `stage`
    (none, or a cell of another process: NotImplementedError when run)."""
    handler = action_handler(name)
    if handler is None or stage is None:
        return _missing_action(name, index)
    method: Callable[[int], None] = partial(handler, stage)
    if stage.sharded is not None and name in SHARDED_ACTIONS:
        return stage.sharded_task(name, method)
    return method


class StepOwner(Protocol):
    """What a step uses of the pipe that runs it (runtime.pipeline.Pipeline is one)."""

    cells: list[Cell | None]
    learns: list[bool]
    services: StageServices

    @property
    def recording(self) -> bool: ...

    def may_draw_random(self) -> bool: ...

    def task_failed(self, error: BaseException) -> None: ...


class Step:
    """A mini-batch between its first and last task. `checkpointed[k][m]`: stage k drops
    micro-batch m's activations in forward and recomputes them; `split`: backward runs as
    input and weight halves (zero bubble); `track`: a graph is recorded for backward."""

    def __init__(
        self,
        pipeline: StepOwner,
        microbatches: Sequence[Value],
        input_needs_grad: Sequence[bool],
        checkpointed: Sequence[Sequence[bool]],
        track: bool,
        *,
        transport: Transport,
        count: int | None = None,
        split: bool = False,
    ) -> None:
        """`microbatches`: the input's, when this process runs cell 0 (else empty, and
        `count` says how many there are); `transport`: the step's own, between its cells."""
        self.report = pipeline.task_failed
        # The first error a task of this step raised itself (not another rank's failure).
        self.own_error: BaseException | None = None
        self.count = len(microbatches) if count is None else count
        self.first_input = microbatches[0] if microbatches else None
        self.track = track
        self.checkpointed = checkpointed
        self.context = StepContext(
            pipeline.services, transport, pipeline.learns, self.count,
            input_needs_grad, checkpointed, track, split, random=pipeline.may_draw_random(),
        )  # fmt: skip
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
            if self.own_error is None and not isinstance(error, PeerFailure):
                self.own_error = error
            self.report(error)
            raise

    def release(self) -> None:
        """Drops everything the step's micro-batches left behind, once it has failed: their
        activations and graphs are freed with the error, not kept with the step."""
        for stage in self.stages:
            if stage is not None:
                stage.release()
        self.context.release()
        self.own_error = None  # its traceback's frames hold the step and their tensors
        self.first_input = None
        self.gathered = ()
        self.exit_grads = None

    def check_backward_once(self) -> None:
        if self.backward_done:
            raise RuntimeError(
                "gpipe_fast: backward through the same pipe output twice is not supported "
                "(its activations are freed as the backward goes); run the pipe again instead"
            )

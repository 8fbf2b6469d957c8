"""The phase drivers of a pipe's steps: schedule, streams, and the native executor's run.

Each phase picks its schedule, joins the caller's streams and runs the schedule on the
executor, whose workers call Step.run_task."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from gpipe_fast.device.streams import CellStreams
from gpipe_fast.errors import PeerFailure
from gpipe_fast.nn.batchnorm import DeferredBatchNorm
from gpipe_fast.nn.microbatch import as_tensors
from gpipe_fast.nn.pytree import Tree
from gpipe_fast.runtime.step import Step
from gpipe_fast.schedule.cache import ScheduleCache
from gpipe_fast.schedule.registry import receiving_actions
from gpipe_fast.transport.protocol import ACTIVATION, GRADIENT, Flow

# The flow of each message a receive action fetches (its action's facts name the message).
FLOWS: dict[str, Flow] = {"activation": ACTIVATION, "gradient": GRADIENT}


def receives() -> dict[str, Flow]:
    """The receive actions registered now and the flow each fetches."""
    return {name: FLOWS[message] for name, message in receiving_actions().items()}


class Runner:
    """Runs steps' schedules on `executor`, one run at a time, and records their task spans
    while `recording` is on. `after_backward` is what a backward leaves to do once every
    cell's is done (tied gradients); `deferred_batch_norms` are committed after a run that
    succeeds and discarded after one that fails; `on_interrupt` is told of Ctrl-C."""

    def __init__(
        self,
        executor: Any,
        schedules: ScheduleCache,
        streams: CellStreams,
        devices: Sequence[torch.device],
        *,
        after_backward: Callable[[], None] = lambda: None,
        deferred_batch_norms: Sequence[DeferredBatchNorm] = (),
        on_interrupt: Callable[[], None] | None = None,
    ) -> None:
        self.executor = executor
        # Called when Ctrl-C stops a run, while its tasks still run (across processes: every
        # rank is told, and the tasks' waits on other ranks end).
        self.on_interrupt = on_interrupt
        self.schedules = schedules
        self.streams = streams
        self.devices = list(devices)
        self.after_backward = after_backward
        self.deferred_batch_norms = list(deferred_batch_norms)
        # Seconds a run may take before TimeoutError (None: no limit).
        self.step_timeout: float | None = None
        self._lock = threading.RLock()  # held around each run and its commit
        # Timeline recording (off: the executor times nothing); `recorded` is the last
        # recorded step's Step.spans.
        self.recording = False
        self.recorded: dict[str, tuple[Any, list[tuple[int, int, int]]]] | None = None
        self.recorded_call_s = 0.0  # the recorded train_step call, entry to return

    def set_recording(self, on: bool) -> None:
        """Records the task spans of the next steps (on) or stops and forgets them (off)."""
        self.executor.set_recording(on)
        self.recording = on
        self.recorded = None
        self.recorded_call_s = 0.0

    def execute(self, schedule: Any, step: Step, phase: str) -> None:
        """One run of `schedule`, each task dispatched to `step`."""
        with self._lock:
            try:
                self._run(schedule, step)
            except BaseException:
                step.release()
                raise
            if step.spans is not None and self.recording:
                step.spans[phase] = (schedule, self.executor.last_spans())
                self.recorded = step.spans
                if phase != "step":  # pipe(x): the caller's loss lies inside the step
                    self.recorded_call_s = 0.0

    def _run(self, schedule: Any, step: Step) -> None:
        own = None
        try:
            self.executor.run(schedule, step.run_task, self.step_timeout or 0.0, self.on_interrupt)
        except PeerFailure:
            # A wait that ended because a task of this rank failed (its rings closed, its
            # failure in the store) may reach the executor before that task's own error
            # does: the task's error is the step's.
            own = step.own_error
            if own is None:
                raise
        if own is not None:
            raise own

    @contextmanager
    def committed(self) -> Iterator[None]:
        """Holds the run lock around a step's run and folds deferred BatchNorm statistics in
        after it: a failed step's statistics never reach the next commit, and a step run from
        another thread is not folded into this one's."""
        with self._lock:
            try:
                yield
            except BaseException:
                for layer in self.deferred_batch_norms:
                    layer.discard()
                raise
            for layer in self.deferred_batch_norms:
                layer.commit()

    # -- phases: on the caller's thread ----------------------------------------------------

    def forward(self, step: Step) -> list[Tree]:
        """The fill-drain forward of pipe(x); the last stage's outputs."""
        schedule = self.schedules.forward(step.count)
        # Every micro-batch is a slice of the same input tensors: one is enough for devices.
        self.streams.cell_waits_caller(0, as_tensors(step.first_input, "input"))
        self.execute(schedule, step, "forward")
        last = step.last_stage()
        outputs = list(last.outputs)
        if not step.track:
            last.outputs = [None] * step.count
        self.streams.join_caller(self.devices[-1])
        return outputs

    def backward(self, step: Step, grads: list[tuple[Tensor | None, ...]]) -> list[Any]:
        """The fill-drain backward of loss.backward(); the input's gradient per micro-batch."""
        step.check_backward_once()
        step.backward_done = True
        last = len(step.stages) - 1
        for m, grad in enumerate(grads):
            step.context.transport.deliver(GRADIENT, last, m, grad)
        flags = tuple(step.checkpointed[0])  # the phase path checkpoints alike on every stage
        schedule = self.schedules.backward(flags)
        self.streams.cells_wait_caller()
        self.execute(schedule, step, "backward")
        self.streams.join_caller(self.devices[0])
        self.after_backward()
        return step.context.input_grads

    def whole_step(self, step: Step, schedule: Any) -> Tensor | None:
        """Every task of a step in one run of `schedule` (a training step's forward, loss and
        backward; an evaluation's forwards and losses; the forwards alone); the step's loss
        (None where this process computed none)."""
        if step.first_input is not None:
            self.streams.cell_waits_caller(0, as_tensors(step.first_input, "input"))
        names = step.action_names
        flows = receives()
        # Every receive's header, posted ahead across processes (nothing to do in one).
        step.context.transport.expect(
            (flows[names[t.action]], t.stage, t.microbatch)
            for t in schedule.tasks
            if names[t.action] in flows
        )
        self.execute(schedule, step, "step")
        for device in {self.devices[k] for k, stage in enumerate(step.stages) if stage}:
            self.streams.join_caller(device)
        losses = [loss for loss in step.context.losses if loss is not None]
        if not losses:
            return None  # the last cell runs in another process
        return torch.stack(losses).sum() if len(losses) > 1 else losses[0]

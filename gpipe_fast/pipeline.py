"""Runs mini-batches through the stages on the native executor: pipe(x) and train_step.

`pipe(x)` runs the fill-drain forward (micro-batch m enters stage k at tick m + k); the user's
`loss.backward()` runs the fill-drain backward through the nodes of bridge.py::

    forward, K=3, M=4                     backward, checkpoint="always" (R: Recompute)
    tick   0   1   2   3   4   5          stage 2: R3 R2 B3 R1 B2 R0 B1 B0
    stage0 F0  F1  F2  F3                 stage 1:    R3 R2 .. B3 R1 B2 R0 B1 B0
    stage1     F0  F1  F2  F3             stage 0:       R3 R2 .. .. B3 R1 ...
    stage2         F0  F1  F2  F3

`train_step(x, target, loss_fn)` runs one schedule of every task instead (forward, loss,
recompute, backward or its input and weight halves), in the order of its kind: "gpipe",
"1f1b", "interleaved" or "zero_bubble" (see csrc/include/gpipe_fast/generators.hpp).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gpipe_fast import _C
from gpipe_fast.batchnorm import DeferredBatchNorm
from gpipe_fast.bridge import Enter, Exit
from gpipe_fast.cell import Cell
from gpipe_fast.checkpoint import recomputed_microbatches
from gpipe_fast.microbatch import Value, as_tensors, batch_size, gather, like, scatter, split_sizes
from gpipe_fast.randomness import TaskRandomness
from gpipe_fast.recompute_memory import RecomputeMemory
from gpipe_fast.schedules import ScheduleCache
from gpipe_fast.step import LossFn, Step
from gpipe_fast.streams import CellStreams

REDUCTIONS = ("mean", "sum")


def _preload_lazy_imports(random_cells: bool) -> None:
    """Takes torch's one-time lazy imports here, when a pipe is built, rather than inside the
    first step's tasks (where they would delay Ctrl-C and count against step_timeout):
    torch.autograd.backward with explicit gradients imports sympy on its first call (~1 s),
    and the first dispatch mode imports torch._dynamo (~2 s; only for cells that may draw
    random numbers, which run under one)."""
    import torch.fx.experimental.symbolic_shapes

    if random_cells:
        with TaskRandomness(0):
            torch.empty(0)


class Pipeline:
    """The stages (cells), their devices and streams, and the executor whose workers run them.
    Stage k runs on worker stage_workers[k]: one worker per stage, except for the interleaved
    schedule, whose workers (one per device given) run several stages each."""

    def __init__(
        self,
        modules: Sequence[nn.Sequential],
        devices: Sequence[torch.device],
        threads_per_cell: int | None,
        *,
        stage_workers: Sequence[int] | None = None,
        schedule: str = "gpipe",
        recompute_pool: bool = False,
    ) -> None:
        self.devices = list(devices)
        self.stage_workers = list(stage_workers or range(len(modules)))
        self.streams = CellStreams(self.devices, self.stage_workers)
        self.cells = [
            Cell(k, module, device, self.streams, threads_per_cell)
            for k, (module, device) in enumerate(zip(modules, self.devices, strict=True))
        ]
        self.kind = schedule
        self.schedules = ScheduleCache(self.stage_workers, schedule)
        self.recompute_memory = RecomputeMemory(self.devices) if recompute_pool else None
        self.executor = _C.Executor(self.schedules.workers, self.streams.backend)
        self.executor.set_streams(self.streams.native())
        self.threads_per_cell = threads_per_cell
        # Seconds a run may take before TimeoutError (None: no limit).
        self.step_timeout: float | None = None
        self.deferred_batch_norms = [
            layer for m in modules for layer in m.modules() if isinstance(layer, DeferredBatchNorm)
        ]
        _preload_lazy_imports(random_cells=any(cell.may_draw_random() for cell in self.cells))
        self._run_lock = threading.RLock()  # held around each run and its commit
        # Keeps the phony leaf alive: every pipe output hangs off it.
        self._phony = torch.empty(0, requires_grad=True)
        # Timeline recording (off: the executor times nothing); `recorded` is the last
        # recorded step's Step.spans.
        self.recording = False
        self.recorded: dict[str, tuple[Any, list[tuple[int, int, int]]]] | None = None
        # Steps between pipe(x) and their backward, for memory_stats() (weak: a dropped output
        # frees its step).
        self.live_steps: weakref.WeakSet[Step] = weakref.WeakSet()

    def may_draw_random(self) -> bool:
        return any(cell.may_draw_random() for cell in self.cells)

    def set_recording(self, on: bool) -> None:
        """Records the task spans of the next steps (on) or stops and forgets them (off)."""
        self.executor.set_recording(on)
        self.recording = on
        self.recorded = None

    def execute(self, schedule: Any, step: Step, phase: str) -> None:
        with self._run_lock:
            self.executor.run(schedule, step.run_task, self.step_timeout or 0.0)
            if step.spans is not None and self.recording:
                step.spans[phase] = (schedule, self.executor.last_spans())
                self.recorded = step.spans

    def _committed(self, run: Any) -> Any:
        """Runs `run()` under the run lock and folds deferred BatchNorm statistics in after
        it: a failed step's statistics never reach the next commit, and a step run from
        another thread is not folded into this one's."""
        with self._run_lock:
            try:
                result = run()
            except BaseException:
                for layer in self.deferred_batch_norms:
                    layer.discard()
                raise
            for layer in self.deferred_batch_norms:
                layer.commit()
        return result

    # -- pipe(x) ---------------------------------------------------------------------------

    def run(self, input: Value, chunks: int, checkpoint: str, training: bool) -> Value:
        with torch.no_grad():
            microbatches = scatter(input, chunks)
        given = as_tensors(input, "input")
        track = torch.is_grad_enabled() and (
            any(cell.learns for cell in self.cells) or any(t.requires_grad for t in given)
        )
        input_needs_grad = [track and t.requires_grad for t in given]
        flags = recomputed_microbatches(checkpoint if training else "never", len(microbatches))
        step = Step(self, microbatches, input_needs_grad, [flags] * len(self.cells), track)
        if track:
            self.live_steps.add(step)
        outputs = self._committed(step.forward)
        if not track:
            return gather(outputs)
        step.gathered = as_tensors(gather([_detached(o) for o in outputs]), "output")
        inputs = [t for t, needs in zip(given, input_needs_grad, strict=True) if needs]
        phony = Enter.apply(step, self._phony, *inputs)
        result = Exit.apply(step, phony)
        return like(as_tensors(result, "output"), outputs[0])

    # -- train_step ------------------------------------------------------------------------

    def train_step(
        self,
        input: Value,
        target: Any,
        loss_fn: LossFn,
        *,
        chunks: int,
        checkpoint: str,
        training: bool,
        reduction: str,
    ) -> Tensor:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        given = as_tensors(input, "input")
        with torch.no_grad():
            microbatches = scatter(input, chunks)
            targets = _scatter_target(target, batch_size(given, "input"), chunks)
        count = len(microbatches)
        schedule, flags = self.schedules.train_step(count, checkpoint if training else "never")
        input_needs_grad = [t.requires_grad for t in given]
        step = Step(
            self, microbatches, input_needs_grad, flags, True, split=self.kind == "zero_bubble"
        )
        context = step.context
        context.loss_fn = loss_fn
        context.targets = targets
        sizes = split_sizes(batch_size(given, "input"), chunks)
        total = sum(sizes)
        context.loss_weights = [n / total for n in sizes] if reduction == "mean" else [1.0] * count
        loss = self._committed(lambda: step.train(schedule))
        _accumulate_input_grads(given, input_needs_grad, context.input_grads)
        return loss  # type: ignore[no-any-return]

    def close(self) -> None:
        self.executor.close()
        if self.recompute_memory is not None:
            self.recompute_memory.close()


def _detached(value: Value) -> Value:
    return like([t.detach() for t in as_tensors(value, "output")], value)


def _scatter_target(target: Any, batch: int, chunks: int) -> list[Any]:
    """The target split like the input (same micro-batch sizes); ValueError naming `target`
    when its batch differs."""
    tensors = as_tensors(target, "target")
    size = batch_size(tensors, "target")
    if size != batch:
        raise ValueError(f"target has batch size {size} (dim 0) but input has {batch}")
    return scatter(target, chunks)


def _accumulate_input_grads(
    given: Sequence[Tensor], needs: Sequence[bool], microbatch_grads: Sequence[Any]
) -> None:
    """Adds the input's gradient into the caller's tensors, as backward() would."""
    for position, (tensor, wanted) in enumerate(zip(given, needs, strict=True)):
        if not wanted:
            continue
        pieces = [grads[position] if grads is not None else None for grads in microbatch_grads]
        present = [p for p in pieces if p is not None]
        if len(present) < len(pieces):
            continue  # the input did not reach the loss: no gradient, as backward() leaves it
        grad = torch.cat([p.to(device=tensor.device, dtype=tensor.dtype) for p in present])
        torch.autograd.backward(tensor, grad)

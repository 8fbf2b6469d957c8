"""Runs one mini-batch through the cells on the native executor, forward and backward.

A step is two schedules. `pipe(x)` runs the fill-drain forward (micro-batch m enters cell k
at tick m + k); the user's `loss.backward()` runs the fill-drain backward::

    forward, K=3, M=4                     backward, checkpoint="always" (R: Recompute)
    tick   0   1   2   3   4   5          cell 2: R3 B3 R2 B2 R1 B1 R0 B0
    cell0  F0  F1  F2  F3                 cell 1:    R3 .. B3 R2 B2 R1 B1 R0 B0
    cell1      F0  F1  F2  F3             cell 0:       R3 .. .. B3 R2 B2 ...
    cell2          F0  F1  F2  F3

Backward reaches the executor through two autograd nodes (see DESIGN.md, "Hazard"):
`_Exit` sits on the pipe's output and only stores the incoming gradient, returning at once
(it may run on a CUDA device thread of the autograd engine, which must never block);
`_Enter` receives a zero-size CPU gradient from `_Exit`, so the engine runs it on the
thread that called backward(), where it is safe to wait for the cells' workers.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gpipe_fast import _C
from gpipe_fast.batchnorm import DeferredBatchNorm, frozen_running_stats, plain_batch_norms
from gpipe_fast.checkpoint import pass_flags, recomputed_microbatches
from gpipe_fast.microbatch import Value, as_tensors, gather, like, scatter
from gpipe_fast.randomness import TaskRandomness, draw_step_seed, may_draw_random, task_seed
from gpipe_fast.recompute_memory import RecomputeMemory
from gpipe_fast.streams import CellStreams

_PASS_NAMES = {
    _C.TaskKind.Forward: "forward",
    _C.TaskKind.Recompute: "recompute",
    _C.TaskKind.Backward: "backward",
}


@dataclass(frozen=True)
class _AutocastState:
    """The caller's autocast settings, replayed on the worker threads."""

    settings: tuple[tuple[str, bool, torch.dtype], ...]

    @property
    def enabled(self) -> bool:
        return any(on for _, on, _ in self.settings)

    @classmethod
    def capture(cls) -> _AutocastState:
        return cls(
            tuple(
                (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                for kind in ("cpu", "cuda")
            )
        )

    def enter(self, stack: ExitStack) -> None:
        for kind, enabled, dtype in self.settings:
            if enabled:
                stack.enter_context(torch.autocast(kind, dtype=dtype))


def _annotate(
    error: BaseException, cell: int, microbatch: int, kind: Any, *, boundary_copy: bool = False
) -> None:
    """Names the cell, micro-batch and pass (or the boundary copy into the cell) in the error's
    message, keeping its type."""
    what = f"boundary copy ({_PASS_NAMES[kind]})" if boundary_copy else f"{_PASS_NAMES[kind]} pass"
    where = f"gpipe_fast: in cell {cell}, micro-batch {microbatch}, {what}"
    if (
        error.args
        and isinstance(error.args[0], str)
        and not error.args[0].startswith("gpipe_fast:")
    ):
        error.args = (f"{where}: {error.args[0]}", *error.args[1:])
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(where)


def _detach_to(
    value: tuple[Tensor, ...],
    device: torch.device,
    streams: CellStreams,
    cell: int,
    requires_grad: Sequence[bool],
) -> tuple[Tensor, ...]:
    """The boundary crossing: the tensors on `device` as fresh autograd leaves."""
    return tuple(
        streams.receive(tensor.detach(), device, cell, from_caller=cell == 0).requires_grad_(grad)
        for tensor, grad in zip(value, requires_grad, strict=True)
    )


def _engine_backward(roots: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """torch.autograd.backward without its argument checks, which cost ~20 us a call (a
    symbolic shape comparison per root); here roots and gradients come from the pipe itself
    and match by construction. Falls back to the public call if torch moves the entry point."""
    _engine_run_backward(
        tuple(roots), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def _public_backward(roots: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    torch.autograd.backward(list(roots), list(grads))


try:
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - older or newer torch without the private helper
    _run_backward = _public_backward
else:
    _run_backward = _engine_backward


class Step:
    """One mini-batch between `pipe(x)` and its backward: stashed cell inputs, the outputs
    (with their graphs where not checkpointed) and the gradients travelling back."""

    def __init__(
        self,
        pipeline: Pipeline,
        microbatches: list[Value],
        input_needs_grad: list[bool],
        checkpointed: list[bool],
        track: bool,
        cells_learn: list[bool],
    ) -> None:
        cells, count = len(pipeline.cells), len(microbatches)
        self.pipeline = pipeline
        self.first_inputs = microbatches
        self.input_needs_grad = input_needs_grad
        self.checkpointed = checkpointed
        self.track = track
        self.seed = draw_step_seed() if pipeline.may_draw_random() else 0
        self.autocast = _AutocastState.capture()
        self.inputs: list[list[Any]] = [[None] * count for _ in range(cells)]
        self.outputs: list[list[Any]] = [[None] * count for _ in range(cells)]
        self.output_grads: list[list[Any]] = [[None] * count for _ in range(cells)]
        self.input_grads: list[Any] = [None] * count
        self.exit_grads: Any = None
        self.gathered: tuple[Tensor, ...] = ()
        # Whether the input of cell k can need a gradient: something before it learns.
        upstream = any(input_needs_grad)
        self.needs_input_grad = []
        for learns in cells_learn:
            self.needs_input_grad.append(upstream)
            upstream = upstream or (track and learns)
        self.backward_done = False
        # Per cell (each slot touched only by its worker): inside a boundary copy, so that an
        # error raised there is named as the copy rather than the cell's compute.
        self.copying = [False] * cells
        # Recording: phase -> (schedule, the executor's spans of its run); None when off.
        self.spans: dict[str, tuple[Any, list[tuple[int, int, int]]]] | None = (
            {} if pipeline.recording else None
        )

    # -- tasks: each runs on its cell's worker thread --------------------------------------

    def run_task(self, kind: Any, cell: int, microbatch: int) -> None:
        try:
            if kind == _C.TaskKind.Forward:
                self._forward(cell, microbatch)
            elif kind == _C.TaskKind.Recompute:
                self._recompute(cell, microbatch)
            else:
                self._backward(cell, microbatch)
        except BaseException as error:
            _annotate(error, cell, microbatch, kind, boundary_copy=self.copying[cell])
            self.copying[cell] = False
            raise

    def _forward(self, cell: int, m: int) -> None:
        pipeline = self.pipeline
        if cell == 0:
            source = self.first_inputs[m]
            flags = self.input_needs_grad
        else:
            source = self.outputs[cell - 1][m]
            if not (self.track and not self.checkpointed[m]):
                self.outputs[cell - 1][m] = None  # no graph to keep: the stash below suffices
            flags = [
                self.needs_input_grad[cell] and t.is_floating_point()
                for t in as_tensors(source, f"output of cell {cell - 1}")
            ]
        # The flag stays set if the copy raises, so run_task names the copy, not the compute.
        self.copying[cell] = True
        tensors = _detach_to(
            as_tensors(source, "input"), pipeline.devices[cell], pipeline.streams, cell, flags
        )
        self.copying[cell] = False
        checkpointing = self.track and self.checkpointed[m]
        output = self._run_cell(
            cell,
            m,
            like(tensors, source),
            grad=self.track and not checkpointing,
            checkpointing=checkpointing,
        )
        as_tensors(output, f"the output of cell {cell}")
        if self.track:
            self.inputs[cell][m] = like(tensors, source)
        self.outputs[cell][m] = output

    def _recompute(self, cell: int, m: int) -> None:
        memory = self.pipeline.recompute_memory
        with nullcontext() if memory is None else memory.use(cell):
            self.outputs[cell][m] = self._run_cell(
                cell, m, self.inputs[cell][m], grad=True, recomputing=True
            )

    def _backward(self, cell: int, m: int) -> None:
        pipeline = self.pipeline
        outputs = as_tensors(self.outputs[cell][m], f"the output of cell {cell}")
        grads = self.output_grads[cell][m]
        roots, root_grads = [], []
        for output, grad in zip(outputs, grads, strict=True):
            if output.requires_grad and grad is not None:
                roots.append(output)
                self.copying[cell] = True  # as in _forward
                root_grads.append(
                    pipeline.streams.receive(
                        grad, output.device, cell, from_caller=cell == len(pipeline.cells) - 1
                    )
                )
                self.copying[cell] = False
        if roots:
            with pipeline.streams.on(cell), torch.enable_grad():
                _run_backward(roots, root_grads)
        inputs = as_tensors(self.inputs[cell][m], "input")
        input_grads = tuple(t.grad if t.requires_grad else None for t in inputs)
        if cell > 0:
            self.output_grads[cell - 1][m] = input_grads
        else:
            self.input_grads[m] = input_grads
        self.inputs[cell][m] = self.outputs[cell][m] = self.output_grads[cell][m] = None

    def _run_cell(
        self,
        cell: int,
        m: int,
        value: Value,
        *,
        grad: bool,
        checkpointing: bool = False,
        recomputing: bool = False,
    ) -> Value:
        """Runs one cell on one micro-batch under what its forward needs: its worker's
        settings, its stream, the caller's autocast, the pass flags, the task's own random
        generators, and (recomputing) frozen BatchNorm statistics. The common CPU case skips
        every part it does not need: this runs on every task."""
        pipeline = self.pipeline
        pipeline.prepare_worker(cell)
        module = pipeline.cells[cell]
        key = (cell, module.training)
        random = pipeline.random_cells.get(key, True)
        batch_norms = pipeline.batch_norms[cell] if recomputing else []
        flags = pass_flags(checkpointing=checkpointing, recomputing=recomputing)
        if not (random or batch_norms or self.autocast.enabled or pipeline.streams.streams[cell]):
            with flags, torch.set_grad_enabled(grad):
                return module(value)
        with ExitStack() as stack:
            stack.enter_context(pipeline.streams.on(cell))
            self.autocast.enter(stack)
            stack.enter_context(flags)
            stack.enter_context(frozen_running_stats(batch_norms))
            stack.enter_context(torch.set_grad_enabled(grad))
            randomness = None
            if random:
                randomness = stack.enter_context(TaskRandomness(task_seed(self.seed, cell, m)))
            output = module(value)
        if randomness is not None:
            pipeline.random_cells[key] = randomness.used
        return output

    # -- phases: run on the caller's thread ------------------------------------------------

    def forward(self) -> list[Value]:
        pipeline = self.pipeline
        schedule = _C.gpipe_forward(len(pipeline.cells), len(self.first_inputs))
        # Every micro-batch is a slice of the same input tensors: one is enough for devices.
        pipeline.streams.cell_waits_caller(0, as_tensors(self.first_inputs[0], "input"))
        pipeline.execute(schedule, self)
        if self.spans is not None:
            self.spans["forward"] = (schedule, pipeline.executor.last_spans())
            pipeline.recorded = self.spans  # the last step: its backward will add to it
        last = len(pipeline.cells) - 1
        outputs = self.outputs[last]
        if not self.track:
            self.outputs[last] = [None] * len(outputs)
        pipeline.streams.join_caller(pipeline.devices[last])
        return outputs

    def check_backward_once(self) -> None:
        if self.backward_done:
            raise RuntimeError(
                "gpipe_fast: backward through the same pipe output twice is not supported "
                "(its activations are freed as the backward goes); run the pipe again instead"
            )

    def backward(self, grads: list[tuple[Tensor | None, ...]]) -> list[tuple[Tensor | None, ...]]:
        self.check_backward_once()
        self.backward_done = True
        pipeline = self.pipeline
        last = len(pipeline.cells) - 1
        self.output_grads[last] = grads
        schedule = _C.gpipe_backward(len(pipeline.cells), len(self.first_inputs), self.checkpointed)
        pipeline.streams.cells_wait_caller()
        pipeline.execute(schedule, self)
        if self.spans is not None and pipeline.recording:
            self.spans["backward"] = (schedule, pipeline.executor.last_spans())
        pipeline.streams.join_caller(pipeline.devices[0])
        return self.input_grads


class _Enter(torch.autograd.Function):
    """Entry of the step's graph: its backward drives the pipelined backward on the caller's
    thread (its only incoming gradient is a zero-size CPU tensor)."""

    @staticmethod
    def forward(ctx: Any, step: Step, phony: Tensor, *inputs: Tensor) -> Tensor:  # type: ignore[override]
        ctx.step = step
        ctx.input_meta = [(t.device, t.dtype) for t in inputs]
        return torch.empty(0)  # the phony: carries no data, only the edge to _Exit

    @staticmethod
    def backward(ctx: Any, _grad: Tensor) -> Any:  # type: ignore[override]
        step: Step = ctx.step
        microbatch_grads = step.backward(step.exit_grads)
        ctx.step = step.exit_grads = None
        grads: list[Tensor | None] = []
        tracked = [i for i, needs in enumerate(step.input_needs_grad) if needs]
        for position, (device, dtype) in zip(tracked, ctx.input_meta, strict=True):
            pieces = [g[position] for g in microbatch_grads]
            present = [p for p in pieces if p is not None]
            if len(present) < len(pieces):
                grads.append(None)
            else:
                grads.append(torch.cat([p.to(device=device, dtype=dtype) for p in present]))
        return (None, None, *grads)


class _Exit(torch.autograd.Function):
    """The pipe's output: gathers the last cell's micro-batches; its backward only hands the
    gradient to the step and returns, so it never blocks an autograd device thread."""

    @staticmethod
    def forward(ctx: Any, step: Step, phony: Tensor) -> Any:  # type: ignore[override]
        outputs, step.gathered = step.gathered, ()
        ctx.step = step
        ctx.sizes = [as_tensors(o, "output")[0].size(0) for o in step.outputs[-1]]
        ctx.integral = [not o.is_floating_point() for o in outputs]
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:  # type: ignore[override]
        step: Step = ctx.step
        step.check_backward_once()
        split = [
            g.split(ctx.sizes) if not skip else [None] * len(ctx.sizes)
            for g, skip in zip(grads, ctx.integral, strict=True)
        ]
        step.exit_grads = [tuple(column[m] for column in split) for m in range(len(ctx.sizes))]
        return None, torch.empty(0)  # a CPU gradient: _Enter runs on the caller's thread


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
    """The cells, their devices and streams, and the executor whose workers run them."""

    def __init__(
        self,
        cells: Sequence[nn.Sequential],
        devices: Sequence[torch.device],
        threads_per_cell: int | None,
        *,
        recompute_pool: bool = False,
    ) -> None:
        self.cells = list(cells)
        self.devices = list(devices)
        self.streams = CellStreams(self.devices)
        self.recompute_memory = RecomputeMemory(self.devices) if recompute_pool else None
        self.executor = _C.Executor(len(self.cells), self.streams.backend)
        self.executor.set_streams(self.streams.native())
        self.threads_per_cell = threads_per_cell
        # Seconds a forward or backward phase may take before TimeoutError (None: no limit).
        self.step_timeout: float | None = None
        self.batch_norms = [plain_batch_norms(cell) for cell in self.cells]
        self.deferred_batch_norms = [
            layer
            for cell in self.cells
            for layer in cell.modules()
            if isinstance(layer, DeferredBatchNorm)
        ]
        # (cell, training) -> whether the cell drew random numbers; absent means unknown.
        self.random_cells: dict[tuple[int, bool], bool] = {}
        for k, cell in enumerate(self.cells):
            if not may_draw_random(cell):
                self.random_cells[(k, True)] = self.random_cells[(k, False)] = False
        _preload_lazy_imports(random_cells=len(self.random_cells) < 2 * len(self.cells))
        self._prepared: set[int] = set()
        self._run_lock = threading.RLock()  # run() holds it around execute()
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
        return any(
            self.random_cells.get((k, cell.training), True) for k, cell in enumerate(self.cells)
        )

    def prepare_worker(self, cell: int) -> None:
        """Per-worker settings, made once on the worker's own thread."""
        if cell in self._prepared:
            return
        self._prepared.add(cell)
        if self.devices[cell].type == "cpu" and self.threads_per_cell is not None:
            torch.set_num_threads(self.threads_per_cell)

    def set_recording(self, on: bool) -> None:
        """Records the task spans of the next steps (on) or stops and forgets them (off)."""
        self.executor.set_recording(on)
        self.recording = on
        self.recorded = None

    def execute(self, schedule: Any, step: Step) -> None:
        with self._run_lock:
            self.executor.run(schedule, step.run_task, self.step_timeout or 0.0)

    def run(self, input: Value, chunks: int, checkpoint: str, training: bool) -> Value:
        with torch.no_grad():
            microbatches = scatter(input, chunks)
        given = as_tensors(input, "input")
        cells_learn = [any(p.requires_grad for p in cell.parameters()) for cell in self.cells]
        track = torch.is_grad_enabled() and (
            any(cells_learn) or any(t.requires_grad for t in given)
        )
        input_needs_grad = [track and t.requires_grad for t in given]
        count = len(microbatches)
        checkpointed = recomputed_microbatches(checkpoint if training else "never", count)
        step = Step(self, microbatches, input_needs_grad, checkpointed, track, cells_learn)
        if track:
            self.live_steps.add(step)
        # One lock over the forward and the commit: deferred BatchNorm statistics of a step
        # run from another thread must not be folded into this one's.
        with self._run_lock:
            try:
                outputs = step.forward()
            except BaseException:
                for layer in self.deferred_batch_norms:
                    layer.discard()  # a failed step's statistics must not reach the next commit
                raise
            for layer in self.deferred_batch_norms:
                layer.commit()
        if not track:
            return gather(outputs)
        step.gathered = as_tensors(gather([_detached(o) for o in outputs]), "output")
        inputs = [t for t, needs in zip(given, input_needs_grad, strict=True) if needs]
        phony = _Enter.apply(step, self._phony, *inputs)
        result = _Exit.apply(step, phony)
        return like(as_tensors(result, "output"), outputs[0])

    def close(self) -> None:
        self.executor.close()
        if self.recompute_memory is not None:
            self.recompute_memory.close()


def _detached(value: Value) -> Value:
    return like([t.detach() for t in as_tensors(value, "output")], value)

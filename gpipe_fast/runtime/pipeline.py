"""A pipe's runtime, composed: its cells, streams, schedules, executor and step side.

The side its steps run on is one process, or this rank's part across processes.

Every step but one runs here, as one whole schedule (`Pipeline.run`: train_step, eval_step,
pipe(x) without gradients across processes); pipe(x) with gradients in one process runs
through runtime/autograd_call.py. The schedule kinds: "gpipe", "1f1b", "interleaved", "zero_bubble",
"zbv" and any registered (gpipe_fast/schedule/registry.py).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from gpipe_fast import _C
from gpipe_fast.arguments import check_loss_arguments
from gpipe_fast.device.recompute_pool import RecomputeMemory
from gpipe_fast.device.streams import CellStreams
from gpipe_fast.distributed.driver import CrossProcess
from gpipe_fast.distributed.host_peers import HostPeers, host_peers
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.distributed.process_groups import ProcessGroups
from gpipe_fast.distributed.sharded import Sharding
from gpipe_fast.nn.batchnorm import DeferredBatchNorm
from gpipe_fast.nn.microbatch import BatchShare, Value, gather
from gpipe_fast.nn.pytree import Tree
from gpipe_fast.nn.randomness import DrawWatch
from gpipe_fast.nn.tied import TiedGradients
from gpipe_fast.runtime.cell import Cell
from gpipe_fast.runtime.context import StageServices
from gpipe_fast.runtime.one_process import OneProcess
from gpipe_fast.runtime.runner import Runner
from gpipe_fast.runtime.step import Step
from gpipe_fast.runtime.step_path import (
    accumulate_input_grads,
    check_items,
    set_loss,
    teller,
    without_items,
)
from gpipe_fast.runtime.step_request import StepRequest, StepSide
from gpipe_fast.schedule.cache import ScheduleCache
from gpipe_fast.schedule.registry import schedule_kind
from gpipe_fast.skip.layout import SkipLayout
from gpipe_fast.transport.protocol import Transport


def _preload_lazy_imports(random_cells: bool) -> None:
    """Takes torch's one-time lazy imports here, when a pipe is built, rather than inside the
    first step's tasks (where they would delay Ctrl-C and count against step_timeout):
    torch.autograd.backward with explicit gradients imports sympy on its first call (~1 s),
    and the first dispatch mode imports torch._dynamo (~2 s; only for cells that may draw
    random numbers, whose first backward is watched by one)."""
    import torch.fx.experimental.symbolic_shapes

    if random_cells:
        with DrawWatch():
            torch.empty(0)


class Pipeline:
    """The stages (cells), their devices and streams, the executor whose workers run them,
    and the side its steps run on. Stage k runs on worker stage_workers[k], placed by the
    schedule's kind: one worker per stage, or several stages per worker (interleaved, zbv)."""

    def __init__(
        self,
        modules: Sequence[nn.Sequential],
        devices: Sequence[torch.device],
        threads_per_cell: int | None,
        *,
        stage_workers: Sequence[int] | None = None,
        schedule: str = "gpipe",
        recompute_pool: bool = False,
        layout: ProcessLayout | None = None,
        timeout_s: float = 300.0,
        tied: TiedGradients | None = None,
        skips: SkipLayout | None = None,
        hosts: HostPeers | None = None,
        ready: Callable[[], None] | None = None,
        dp_shard: bool = False,
    ) -> None:
        self.layout = layout or ProcessLayout(None, None, (0,), 0, len(modules))
        self.timeout_s = timeout_s
        self.tied = tied
        # A step may pass target=None to a loss_fn that needs none (a model computing its
        # own loss: gf.pipeline's pipes).
        self.targets_optional = False
        self.devices = list(devices)
        self.stage_workers = list(stage_workers or range(len(modules)))
        # Across processes this one runs its cells on one compute worker (stage s of the
        # whole pipeline is on the worker of its rank, placed by the kind); others' cells are
        # placeholders here.
        local = [self.layout.is_local(k) for k in range(len(modules))]
        worker_ranks = None
        if self.layout.multi_process:
            worker_ranks = list(range(self.layout.pp_size))
            self.stage_workers = [self.layout.stage_rank(k) for k in range(len(modules))]
        # Replicated cells sum their gradients over dp as each backward ends; sharded cells
        # (FSDP2) reduce-scatter them themselves.
        reduce_grad = self.layout.dp_group is not None and not dp_shard
        # The learning flags of every cell (also those of other processes: they decide
        # which inputs need a gradient).
        self.learns = [any(p.requires_grad for p in m.parameters()) for m in modules]
        local_workers = [0 if self.layout.multi_process else w for w in self.stage_workers]
        self.streams = CellStreams(self.devices, local_workers)
        self.cells: list[Cell | None] = [
            Cell(k, module, device, self.streams, threads_per_cell) if here else None
            for k, (module, device, here) in enumerate(
                zip(modules, self.devices, local, strict=True)
            )
        ]
        self.kind = schedule
        self.split_backward = schedule_kind(schedule).split_backward
        # The side the steps run on: across processes (every rank's host and process known,
        # so that its guard names a rank that died), or this one alone.
        hosts = hosts or (host_peers() if self.layout.multi_process or reduce_grad else None)
        self.cross: CrossProcess | None = None
        if hosts is not None:
            here = [cell.module if cell is not None else None for cell in self.cells]
            device = self.devices[self.layout.local_cells[0]]
            self.cross = CrossProcess.open(
                self.layout, device, hosts, timeout_s, here, tied, skips, ready
            )
        self.side: StepSide = self.cross if self.cross is not None else OneProcess(tied)
        # The media between the pipeline group's processes, chosen once per pipe.
        self.media = self.side.media
        self.transport_choice = self.media.choice
        self.schedules = ScheduleCache(
            self.stage_workers,
            schedule,
            worker_ranks=worker_ranks,
            rank=self.layout.pp_index,
            reduce_grad=reduce_grad,
            skips=sorted(skips.pairs()) if skips else (),
            inline_receives=self.media.inline_receives,
        )
        self.recompute_memory = RecomputeMemory(self.devices) if recompute_pool else None
        # One worker per local compute worker, then the communication workers of a lowered
        # schedule (as many as its schedules have: one per flow received).
        streams = self.streams.native()
        if self.schedules.lowered:
            workers = self.schedules.train_step(1, "never")[0].workers
            streams += [self.streams.communication_stream() for _ in range(workers - len(streams))]
        self.executor = _C.Executor(len(streams), self.streams.backend)
        self.executor.set_streams(streams)
        self.threads_per_cell = threads_per_cell
        self.services = StageServices(
            self.devices,
            self.streams,
            self.recompute_memory,
            self.cross.reduce_gradients if reduce_grad and self.cross is not None else None,
            skips,
        )
        deferred_batch_norms = [
            layer
            for k, m in enumerate(modules)
            if local[k]
            for layer in m.modules()
            if isinstance(layer, DeferredBatchNorm)
        ]
        self.runner = Runner(
            self.executor,
            self.schedules,
            self.streams,
            self.devices,
            after_backward=self.side.after_backward,
            deferred_batch_norms=deferred_batch_norms,
            on_interrupt=self.cross.interrupt if self.cross is not None else None,
        )
        _preload_lazy_imports(random_cells=self.may_draw_random())
        # Keeps the phony leaf alive: every output of pipe(x) hangs off it.
        self.phony = torch.empty(0, requires_grad=True)
        # Steps between pipe(x) and their backward, for memory_stats() (weak: a dropped output
        # frees its step).
        self.live_steps: weakref.WeakSet[Step] = weakref.WeakSet()

    @property
    def local_cells(self) -> list[Cell]:
        return [cell for cell in self.cells if cell is not None]

    @property
    def groups(self) -> ProcessGroups | None:
        """The guard and groups of a pipe across processes (None in one process)."""
        return self.cross.groups if self.cross is not None else None

    @property
    def sharding(self) -> Sharding | None:
        """The cells sharded over dp (FSDP2), after shard(); None: replicated or no dp."""
        return self.cross.sharding if self.cross is not None else None

    # The runner's settings and records, as GPipe reads and sets them.
    @property
    def step_timeout(self) -> float | None:
        return self.runner.step_timeout

    @step_timeout.setter
    def step_timeout(self, seconds: float | None) -> None:
        self.runner.step_timeout = seconds

    @property
    def recording(self) -> bool:
        return self.runner.recording

    @property
    def recorded(self) -> dict[str, tuple[Any, list[tuple[int, int, int]]]] | None:
        return self.runner.recorded

    @property
    def recorded_call_s(self) -> float:
        return self.runner.recorded_call_s

    @recorded_call_s.setter
    def recorded_call_s(self, seconds: float) -> None:
        self.runner.recorded_call_s = seconds

    def make_transport(self) -> Transport:
        """A step's transport: in-process, or across the pipeline group's processes."""
        return self.side.make_transport(self.streams, self.devices)

    # -- the step path: a StepRequest run as one whole schedule on the pipe's side ---------

    def run(self, request: StepRequest, input: Value | None, target: Any) -> Any:
        """Runs `request` on the pipe's side: the loss of the whole batch on every rank
        (train, evaluate), or the output of the whole batch where the last cell runs (forward;
        None elsewhere). A training step adds the input's gradient into the caller's tensors.
        While recording, a train or evaluate call's own time is kept (for gf.plan)."""
        if request.program == "forward":
            return self._forward(request, input)
        start = time.perf_counter()
        check_loss_arguments(request.loss_fn, request.reduction)
        share = self.side.share(
            input, target, request.chunks,
            needs_target=self.needs_target(target), counting=request.counting,
            signature=request.signature,
        )  # fmt: skip
        check_items(request, share)
        if request.program == "train":
            loss = self._train(request, share)
        else:
            loss = self._evaluate(request, share)
        if self.recording:
            self.recorded_call_s = time.perf_counter() - start
        return loss

    def _train(self, request: StepRequest, share: BatchShare) -> Tensor:
        """Every forward, loss and backward of the share, in one run."""
        schedule, flags = self.schedules.train_step(share.count, request.checkpoint)
        needs_grad = [t.requires_grad for t in share.given]
        step = Step(
            self, share.microbatches, needs_grad, flags, True,
            transport=self.make_transport(), count=share.count, split=self.split_backward,
        )  # fmt: skip
        set_loss(step, request, share)
        loss = self.side.loss(self._run(step, schedule, request, share, backward=True))
        if share.given:
            accumulate_input_grads(share.given, step.input_needs_grad, step.context.input_grads)
        return loss

    def _evaluate(self, request: StepRequest, share: BatchShare) -> Tensor:
        """The forwards and losses of the share, in one run that records no graph."""
        schedule = self.schedules.forward_only(share.count, loss=True)
        step = self._forward_only_step(share)
        set_loss(step, request, share)
        return self.side.loss(self._run(step, schedule, request, share, backward=False))

    def _forward(self, request: StepRequest, input: Value | None) -> Tree | None:
        """The forwards alone, in one run that records no graph: the output where the last
        cell runs."""
        share = self.side.share(input, None, request.chunks, needs_target=False)
        schedule = self.schedules.forward_only(share.count, loss=False)
        step = self._forward_only_step(share)
        self._run(step, schedule, request, share, backward=False)
        last = step.stages[-1]
        return None if last is None else gather(last.outputs)

    def _forward_only_step(self, share: BatchShare) -> Step:
        """A step that records no graph: nothing needs a gradient, nothing is checkpointed."""
        never = [[False] * share.count for _ in self.cells]
        nothing = [False] * len(share.given)
        return Step(
            self, share.microbatches, nothing, never, False,
            transport=self.make_transport(), count=share.count,
        )  # fmt: skip

    def _run(
        self, step: Step, schedule: Any, request: StepRequest, share: BatchShare, *, backward: bool
    ) -> Tensor | None:
        """This process's part of `step`: the side's hooks in order around one run of
        `schedule`; this process's loss (None: none here)."""
        tell = teller(request, share)
        if tell is not None:
            assert share.items is not None
            tell(max(share.items.total, 1))  # without any item, no micro-batch's loss is used
        try:
            with self.side.running(backward=backward):
                self.side.before_step()
                with self.runner.committed():
                    local = self.runner.whole_step(step, schedule)
                step.context.transport.finish()
                if backward:
                    self.side.after_backward()
                local = without_items(local, share)
        finally:
            if tell is not None:
                tell(None)
        return local

    def task_failed(self, error: BaseException) -> None:
        """Tells the other processes at once, so that their waits end (multi-process)."""
        self.side.report(error)

    def sync_copies(self) -> None:
        """Every copy of a weight starts equal (across processes: see CrossProcess)."""
        if self.cross is not None:
            self.cross.sync_copies()

    def shard(self, *, sync: str, reshard_after_forward: bool) -> None:
        """Shards every local cell over the data-parallel group (after sync_copies)."""
        assert self.cross is not None, "sharding needs a dp_group"
        sharding = self.cross.shard(
            self.devices, sync=sync, reshard_after_forward=reshard_after_forward,
            split=self.split_backward, timeout_s=self.timeout_s,
        )  # fmt: skip
        self.services = replace(self.services, sharding=sharding)

    def needs_target(self, target: Any) -> bool:
        """Whether a step's loss_fn gets micro-batches of `target`: always, but where the
        pipe's model may compute its own loss (`targets_optional`) and `target` is None."""
        return target is not None or not self.targets_optional

    def may_draw_random(self) -> bool:
        return any(cell.may_draw_random() for cell in self.local_cells)

    def whole_backward_cells(self) -> list[int]:
        """The local cells whose split backward runs their compiled layers' backward whole
        in backward_input (none unless the kind splits the backward; sharded cells split
        theirs as ever)."""
        if not self.split_backward:
            return []
        sharded = self.sharding.cells if self.sharding is not None else {}
        return [
            cell.index
            for cell in self.local_cells
            if any(cell.whole_backward) and cell.index not in sharded
        ]

    def set_recording(self, on: bool) -> None:
        """Records the task spans of the next steps (on) or stops and forgets them (off)."""
        self.runner.set_recording(on)

    def close(self) -> None:
        self.executor.close()
        self.side.close()
        if self.recompute_memory is not None:
            self.recompute_memory.close()

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
"1f1b", "interleaved", "zero_bubble", "zbv" (csrc/schedule/kinds.cpp) or one registered
with gf.register_schedule_kind.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe_fast import _C
from gpipe_fast.arguments import check_loss_arguments
from gpipe_fast.device.recompute_pool import RecomputeMemory
from gpipe_fast.device.streams import CellStreams
from gpipe_fast.distributed.driver import CrossProcess
from gpipe_fast.distributed.grad_reduce import sum_gradients
from gpipe_fast.distributed.held_gradients import summing_this_step_only
from gpipe_fast.distributed.host_peers import HostPeers, host_peers
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.distributed.process_groups import ProcessGroups
from gpipe_fast.distributed.sharded import Sharding
from gpipe_fast.distributed.sync_copies import broadcast_replicas, broadcast_ties
from gpipe_fast.distributed.transports.across import skips_between_ranks
from gpipe_fast.distributed.transports.registry import make_transport, open_media
from gpipe_fast.nn.batchnorm import DeferredBatchNorm
from gpipe_fast.nn.cell import Cell
from gpipe_fast.nn.checkpoint import recomputed_microbatches
from gpipe_fast.nn.microbatch import (
    Value,
    as_tensors,
    batch_size,
    gather,
    loss_weights,
    scatter,
    scatter_target,
)
from gpipe_fast.nn.pytree import Tree, map_tensors, tensors_of, with_tensors
from gpipe_fast.nn.randomness import TaskRandomness
from gpipe_fast.nn.tied import TiedGradients
from gpipe_fast.runtime.bridge import Enter, Exit
from gpipe_fast.runtime.context import LossFn, StageServices
from gpipe_fast.runtime.runner import Runner
from gpipe_fast.runtime.step import Step
from gpipe_fast.schedule.cache import ScheduleCache
from gpipe_fast.schedule.registry import schedule_kind
from gpipe_fast.skip.layout import SkipLayout
from gpipe_fast.transport.protocol import Transport

# pipe(x) with gradients cannot serve a pipe of several processes: loss.backward() on one rank
# would not reach the other ranks' cells, nor sum the replicas' gradients.
GROUPS_NEED_STEPS = (
    "gpipe_fast: a pipe with pp_group or dp_group cannot run pipe(x) with gradients "
    "(loss.backward() would not reach the other ranks); on every rank, train with "
    "pipe.train_step(x, target, loss_fn) and evaluate with pipe.eval_step(x, target, loss_fn), "
    "or run pipe(x) under torch.no_grad() for the output"
)


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
    Stage k runs on worker stage_workers[k], placed by the schedule's kind: one worker per
    stage, or several stages per worker (interleaved, zbv)."""

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
        # Sharded stages (FSDP2) reduce-scatter their gradients themselves: no all-reduce.
        self.dp_shard = dp_shard
        self.timeout_s = timeout_s
        self.sharding: Sharding | None = None
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
        # The skip pairs sent between this pipe's ranks, found once for every step's transport.
        self.skips_between_ranks = skips_between_ranks(self.layout, skips)
        # Across processes: every rank's host and process (its guard names a rank that died).
        hosts = hosts or (host_peers() if self.layout.multi_process or reduce_grad else None)
        self.groups = (
            ProcessGroups(self.layout, self.devices[self.layout.local_stages[0]], timeout_s, hosts)
            if hosts is not None
            else None
        )
        # The media between the pipeline group's processes (rings to the ranks on this host,
        # for CPU cells), chosen once per pipe.
        self.media = open_media(
            self.layout,
            hosts,
            self.groups.guard if self.groups is not None else None,
            self.devices[self.layout.local_stages[0]],
            skips,
        )
        self.transport = self.media.choice
        if self.groups is not None and self.media.control is not None:
            self.groups.links = self.media.control
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
            self.reduce_gradients if reduce_grad else None,
            skips,
        )
        # `ready` (raising when this rank cannot run: tensors built on the meta device with
        # no values) is asked at each step's start, so that its error ends the step on every
        # rank like a failure during it.
        self.cross = (
            CrossProcess(self.layout, self.groups, tied, self.task_failed, ready)
            if self.groups is not None
            else None
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
            after_backward=self.after_backward,
            deferred_batch_norms=deferred_batch_norms,
        )
        _preload_lazy_imports(random_cells=self.may_draw_random())
        # Keeps the phony leaf alive: every pipe output hangs off it.
        self._phony = torch.empty(0, requires_grad=True)
        # Steps between pipe(x) and their backward, for memory_stats() (weak: a dropped output
        # frees its step).
        self.live_steps: weakref.WeakSet[Step] = weakref.WeakSet()

    @property
    def local_cells(self) -> list[Cell]:
        return [cell for cell in self.cells if cell is not None]

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
        guard = self.groups.guard if self.groups is not None else None
        return make_transport(
            self.streams, self.devices, self.layout, guard, self.media, self.skips_between_ranks
        )

    def task_failed(self, error: BaseException) -> None:
        """Tells the other processes at once, so that their waits end (multi-process): the
        failure goes to the store, then this rank's rings close."""
        if self.groups is not None:
            guard = self.groups.guard
            guard.report(f"{type(error).__name__}: {error}")
            self.media.fail(f"rank {guard.rank}'s step failed")

    def reduce_gradients(self, stage: int) -> None:
        """Stage `stage`'s gradients summed over the data-parallel group."""
        cell = self.cells[stage]
        assert cell is not None and self.groups is not None
        # A tied parameter is left to after the backward, once (several cells hold it).
        tied = self.tied.members if self.tied else set()
        sum_gradients(
            [p for p in cell.module.parameters() if id(p) not in tied],
            self.layout.dp_group,
            self.groups.guard,
            f"cell {stage}'s gradients from the other replicas",
        )

    def summed_across_ranks(self) -> list[Tensor]:
        """The tensors whose gradients a step sums across ranks: with dp_group, every learning
        parameter of this process's cells (a tie's tensor once, not its replicas on other
        devices, which are added into it first); else the tied weights' copies."""
        tied = self.tied.local_tensors() if self.tied else []
        if self.layout.dp_group is None or self.dp_shard:
            summed = tied if self.layout.multi_process else []
        else:
            members = self.tied.members if self.tied else set()
            own = [
                p
                for cell in self.local_cells
                for p in cell.module.parameters()
                if id(p) not in members
            ]
            summed = own + tied
        return [t for t in summed if t.requires_grad]

    def sync_copies(self) -> None:
        """Every copy of a weight starts equal: tied copies across the pipeline group, then
        every tensor across the data-parallel replicas (sync_copies.py)."""
        if self.groups is None:
            return
        guard = self.groups.guard
        if self.tied and self.layout.multi_process:
            broadcast_ties(self.tied, self.layout, guard, self.groups.device)
        if self.layout.dp_group is not None:
            modules = [cell.module for cell in self.local_cells]
            broadcast_replicas(modules, self.layout.dp_group, guard)

    def shard(self, *, sync: str, reshard_after_forward: bool) -> None:
        """Shards every local cell over the data-parallel group (after sync_copies: each
        replica keeps its share of the same weights)."""
        assert self.layout.dp_group is not None, "sharding needs a dp_group"
        self.sharding = Sharding(
            [cell.module if cell is not None else None for cell in self.cells],
            self.devices,
            self.layout.dp_group,
            sync=sync,
            reshard_after_forward=reshard_after_forward,
            split=self.split_backward,
            timeout_s=self.timeout_s,
        )
        self.services = replace(self.services, sharding=self.sharding)
        if self.cross is not None:
            self.cross.sharded = True
        if self.tied:
            dp = self.layout.dp_group
            self.tied.refresh(
                [cell.module if cell is not None else None for cell in self.cells],
                (dist.get_world_size(dp), dist.get_rank(dp)),
            )

    def start_sharded_step(self) -> None:
        if self.sharding is not None:
            self.sharding.start_step()

    def end_sharded_step(self) -> None:
        """After a step of sharded cells: the replicas ran the same tasks, and no unit is
        left whole (an evaluation's forward may leave them gathered)."""
        if self.sharding is not None:
            self.sharding.check_order()
            self.sharding.reshard()

    def may_draw_random(self) -> bool:
        return any(cell.may_draw_random() for cell in self.local_cells)

    def set_recording(self, on: bool) -> None:
        """Records the task spans of the next steps (on) or stops and forgets them (off)."""
        self.runner.set_recording(on)

    # -- pipe(x) ---------------------------------------------------------------------------

    def run(self, input: Value, chunks: int, checkpoint: str, training: bool) -> Tree:
        if self.groups is not None and (torch.is_grad_enabled() or self.layout.multi_process):
            raise RuntimeError(GROUPS_NEED_STEPS)  # without gradients: gpipe_fast.runtime.evaluate
        with torch.no_grad():
            microbatches = scatter(input, chunks)
        given = as_tensors(input, "input")
        track = torch.is_grad_enabled() and (
            any(self.learns) or any(t.requires_grad for t in given)
        )
        input_needs_grad = [track and t.requires_grad for t in given]
        flags = recomputed_microbatches(checkpoint if training else "never", len(microbatches))
        step = Step(self, microbatches, input_needs_grad, [flags] * len(self.cells), track)
        if track:
            self.live_steps.add(step)
        if self.tied:
            self.tied.before_step()
        self.start_sharded_step()
        outputs = self.runner.committed(lambda: self.runner.forward(step))
        self.end_sharded_step()
        if not track:
            return gather(outputs)
        gathered = gather([map_tensors(Tensor.detach, o) for o in outputs])
        step.gathered = tensors_of(gathered)
        if not step.gathered:
            return gathered  # no tensor: nothing for a backward to reach, as in the plain model
        inputs = [t for t, needs in zip(given, input_needs_grad, strict=True) if needs]
        phony = Enter.apply(self.runner, step, self._phony, *inputs)
        result = Exit.apply(step, phony)
        # The output's structure and other leaves as gathered, its tensors from Exit.
        return with_tensors(gathered, tensors_of(result))

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
        loss_scale: Tensor | None = None,
    ) -> Tensor:
        check_loss_arguments(loss_fn, reduction)
        if self.cross is not None:
            return self._train_step_across_processes(
                input, target, loss_fn, chunks, checkpoint if training else "never", reduction,
                loss_scale,
            )  # fmt: skip
        given = as_tensors(input, "input")
        batch = batch_size(given, "input")
        with torch.no_grad():
            microbatches = scatter(input, chunks)
            targets = (
                scatter_target(target, batch, chunks)
                if self.needs_target(target)
                else [None] * len(microbatches)
            )
        step, schedule = self._training_step(
            microbatches, [t.requires_grad for t in given], len(microbatches), checkpoint,
            training, loss_fn, targets, loss_weights(batch, batch, chunks, reduction), loss_scale,
        )  # fmt: skip
        if self.tied:
            self.tied.before_step()
        loss = self.runner.committed(lambda: self.runner.train(step, schedule))
        self.after_backward()
        _accumulate_input_grads(given, step.context.input_needs_grad, step.context.input_grads)
        return loss  # type: ignore[no-any-return]

    def needs_target(self, target: Any) -> bool:
        """Whether a step's loss_fn gets micro-batches of `target`: always, but where the
        pipe's model may compute its own loss (`targets_optional`) and `target` is None."""
        return target is not None or not self.targets_optional

    def after_backward(self) -> None:
        """What a step's backward leaves to do once every cell's is done: tied gradients."""
        if self.tied:
            self.tied.after_backward()

    def _training_step(
        self,
        microbatches: list[Value],
        input_needs_grad: list[bool],
        count: int,
        checkpoint: str,
        training: bool,
        loss_fn: LossFn,
        targets: list[Any],
        weights: list[float],
        loss_scale: Tensor | None,
    ) -> tuple[Step, Any]:
        schedule, flags = self.schedules.train_step(count, checkpoint if training else "never")
        step = Step(
            self, microbatches, input_needs_grad, flags, True,
            count=count, split=self.split_backward,
        )  # fmt: skip
        step.context.set_loss(loss_fn, targets, weights, loss_scale)
        return step, schedule

    def _train_step_across_processes(
        self,
        input: Value | None,
        target: Any,
        loss_fn: LossFn,
        chunks: int,
        checkpoint: str,
        reduction: str,
        loss_scale: Tensor | None,
    ) -> Tensor:
        """Every rank's share of a training step: the batch's size comes from cell 0's rank,
        the loss from the last cell's; cell 0's rank needs `input`, the last cell's `target`
        (others may pass None)."""
        cross = self.cross
        assert cross is not None
        share = cross.share(input, target, chunks, needs_target=self.needs_target(target))
        given = share.given
        step, schedule = self._training_step(
            share.microbatches, [t.requires_grad for t in given], share.count, checkpoint, True,
            loss_fn, share.targets, loss_weights(share.batch, share.total, chunks, reduction),
            loss_scale,
        )  # fmt: skip
        run = self.runner
        self.start_sharded_step()
        # Gradients left to accumulate from earlier steps stay out of this step's sums.
        with summing_this_step_only(self.summed_across_ranks()):
            local = cross.run(
                lambda: run.committed(lambda: run.train(step, schedule)),
                step.context.transport,
                backward=True,
            )
        self.end_sharded_step()
        loss = cross.loss(local)
        if given:
            _accumulate_input_grads(given, step.context.input_needs_grad, step.context.input_grads)
        return loss

    def close(self) -> None:
        self.executor.close()
        self.media.close()
        if self.recompute_memory is not None:
            self.recompute_memory.close()
        if self.groups is not None:  # its helper threads, one pipe's worth per pipe built
            self.groups.close()


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

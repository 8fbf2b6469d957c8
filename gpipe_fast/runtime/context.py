"""What a step's stages are given: the pipe's services, injected, and the step's shared state."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from gpipe_fast.device.recompute_pool import RecomputeMemory
from gpipe_fast.device.streams import CellStreams
from gpipe_fast.nn.randomness import draw_step_seed
from gpipe_fast.runtime.cell import AutocastState
from gpipe_fast.skip.layout import SkipLayout
from gpipe_fast.transport.protocol import Transport

LossFn = Callable[[Any, Any], Tensor]


class ShardedCell(Protocol):
    """What a stage uses of its cell sharded over dp (FSDP2): distributed/sharded.py's, which
    the pipeline wires in, so that the step's own modules need nothing of distributed/."""

    def task(self, action: str, microbatch: int) -> AbstractContextManager[None]: ...
    def gather(self) -> None: ...
    def backward_done(self, count: int) -> None: ...
    def layer_parameters(self) -> list[list[Tensor]]: ...
    def reset(self) -> None: ...


class ShardedCells(Protocol):
    """The cells sharded over dp, by index (distributed/sharded.py's Sharding)."""

    @property
    def cells(self) -> Mapping[int, ShardedCell]: ...


@dataclass(frozen=True)
class StageServices:
    """What the stages of every step of a pipe use of it: the cells' devices and streams,
    the recompute pools (None: off), the data-parallel gradient reduction (None: no
    dp_group) and where its skip connections are stashed and popped (None: no skippable
    layer)."""

    devices: Sequence[torch.device]
    streams: CellStreams
    recompute_memory: RecomputeMemory | None = None
    reduce_gradients: Callable[[int], None] | None = None
    skips: SkipLayout | None = None
    sharding: ShardedCells | None = None  # the stages sharded over dp (FSDP2); None: replicated


class StepContext:
    """What a step's stages share: its settings, its transport, and what comes back out (the
    losses, the input's gradient). It holds no stage, so that a step's objects form no
    reference cycle and go as soon as the step's output is dropped."""

    def __init__(
        self,
        services: StageServices,
        transport: Transport,
        learns: Sequence[bool],
        count: int,
        input_needs_grad: Sequence[bool],
        checkpointed: Sequence[Sequence[bool]],
        track: bool,
        split: bool,
        *,
        random: bool,
    ) -> None:
        self.services = services
        self.count = count
        self.input_needs_grad = list(input_needs_grad)
        self.checkpointed = checkpointed
        self.track = track
        self.split = split
        # Whether any cell may draw random numbers: then each task draws from its own
        # stream, seeded from the step's seed.
        self.random = random
        self.seed = draw_step_seed() if random else 0
        self.autocast = AutocastState.capture()
        self.transport = transport
        # Whether the input of stage k can need a gradient: something before it learns.
        upstream = any(input_needs_grad)
        self.needs_input_grad = []
        # Whether what stage k computes (its output, its skips) can need a gradient.
        self.computes_grad = []
        for stage_learns in learns:
            self.needs_input_grad.append(upstream)
            upstream = upstream or (track and stage_learns)
            self.computes_grad.append(upstream)
        self.input_grads: list[Any] = [None] * count
        # Filled by train_step: the loss function, targets per micro-batch, their weights.
        self.loss_fn: LossFn | None = None
        self.targets: list[Any] = []
        self.loss_weights: list[float] = []
        # The loss scale of a grad_scaler (a 0-dim tensor), multiplied into each loss's
        # gradient; None: unscaled.
        self.loss_scale: Tensor | None = None
        self.losses: list[Tensor | None] = [None] * count

    def release(self) -> None:
        """Drops the step's per-micro-batch values and what its transport holds (after a
        failed step; Stage.release says why)."""
        self.input_grads = [None] * self.count
        self.losses = [None] * self.count
        self.targets = []
        self.transport.discard()

    def set_loss(
        self,
        loss_fn: LossFn,
        targets: list[Any],
        weights: list[float],
        loss_scale: Tensor | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.targets = targets
        self.loss_weights = weights
        self.loss_scale = loss_scale

    def input_grad_flags(self, stage: int, tensors: Sequence[Tensor]) -> list[bool]:
        if stage == 0:
            return self.input_needs_grad
        needs = self.needs_input_grad[stage]
        return [needs and t.is_floating_point() for t in tensors]

    def target(self, stage: int, m: int) -> Any:
        """Micro-batch m's target on `stage`'s device."""
        device = self.services.devices[stage]
        target = self.targets[m]
        if isinstance(target, Tensor) and target.is_cpu and device.type == "cpu":
            return target  # the common CPU case, on every loss task
        with self.services.streams.on(stage):
            if isinstance(target, Tensor):
                return target.to(device, non_blocking=True)
            if isinstance(target, tuple):
                return tuple(
                    t.to(device, non_blocking=True) if isinstance(t, Tensor) else t for t in target
                )
            return target

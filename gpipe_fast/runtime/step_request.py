"""A step as data (StepRequest), and what each side of the step path does (StepSide)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from gpipe_fast.device.streams import CellStreams
from gpipe_fast.nn.items import Counting
from gpipe_fast.nn.microbatch import BatchShare, Value
from gpipe_fast.runtime.context import LossFn
from gpipe_fast.transport.choice import ChosenMedia
from gpipe_fast.transport.protocol import Transport

# The programs a step may run: every task of a training step; the forwards and losses of an
# evaluation; the forwards alone (pipe(x) under no_grad across processes).
PROGRAMS = ("train", "evaluate", "forward")


@dataclass(frozen=True)
class StepRequest:
    """One step as data: its program (one of PROGRAMS), the micro-batches its batch is
    split into, its checkpointing (a training step's) and its loss (none for "forward"):
    `reduction` weighs the micro-batches' losses by their rows ("mean") or adds them up
    ("sum"), unless `counting` says how to count the items they average over (then each
    weighs its items' share), and `loss_scale` (a GradScaler's) scales their gradients.
    `signature`: the input signature the step expects (an "auto" pipe's current choice's);
    an input of another raises SignatureChanged before any task runs."""

    program: str
    chunks: int
    checkpoint: str = "never"
    loss_fn: LossFn | None = None
    reduction: str = "mean"
    loss_scale: Tensor | None = None
    counting: Counting | None = None
    signature: int | None = None

    def __post_init__(self) -> None:
        if self.program not in PROGRAMS:
            raise ValueError(f"program must be one of {PROGRAMS}, got {self.program!r}")

    @property
    def has_loss(self) -> bool:
        return self.program != "forward"


class StepSide(Protocol):
    """What one side of the step path does around a step: one process, or this rank's
    part across processes. Pipeline.run calls its hooks in order: share, running (around
    before_step, the run, and after_backward), loss. Ties are the side's alone: before_step
    and after_backward are the only places a step touches them."""

    @property
    def media(self) -> ChosenMedia:
        """The media chosen once for the pipe's steps."""

    def report(self, error: BaseException) -> None:
        """Tells whoever else runs the step of a failure here."""

    def make_transport(self, streams: CellStreams, devices: Sequence[torch.device]) -> Transport:
        """A step's transport between the cells."""

    def share(
        self,
        input: Value | None,
        target: Any,
        chunks: int,
        *,
        needs_target: bool,
        counting: Counting | None = None,
        signature: int | None = None,
    ) -> BatchShare:
        """This process's share of the step's batch (with `counting`, and its items); with
        `signature`, SignatureChanged when cell 0's input has another."""

    def running(self, *, backward: bool) -> AbstractContextManager[None]:
        """What this process's part of the step (run inside it) needs around it; a
        `backward` step's sums across ranks see its own gradients only."""

    def before_step(self) -> None:
        """What a step does before its first task: the ties' device replicas refreshed."""

    def after_backward(self) -> None:
        """What a backward leaves to sum once every cell's is done (tied gradients)."""

    def loss(self, local: Tensor | None) -> Tensor:
        """The whole batch's loss, from this process's losses (None: none here)."""

    def close(self) -> None:
        """Releases what the side holds (media, helper threads)."""

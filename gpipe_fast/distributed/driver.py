"""The cross-process step driver: what every rank does around its own run of a step.

The ranks agree on the batch, a failure reaches every rank, sends are awaited, tied and
replicated gradients are summed, and every rank gets the loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gpipe_fast.distributed.grad_reduce import sum_gradients
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.distributed.process_groups import ProcessGroups
from gpipe_fast.nn.microbatch import (
    Value,
    as_tensors,
    batch_size,
    scatter,
    scatter_target,
    split_sizes,
)
from gpipe_fast.nn.tied import TiedGradients
from gpipe_fast.transport.protocol import Transport


@dataclass(frozen=True)
class RankShare:
    """What this process brings to a step across processes: the input's tensors and
    micro-batches (empty without cell 0), the targets (None without the last cell), and the
    batch sizes the ranks agreed on: this pipeline's, and the total over every replica."""

    given: tuple[Tensor, ...]
    microbatches: list[Value]
    targets: list[Any]
    batch: int
    total: int

    @property
    def count(self) -> int:
        return len(self.targets)


def rank_share(
    layout: ProcessLayout,
    groups: ProcessGroups,
    report: Callable[[BaseException], None],
    input: Value | None,
    target: Any,
    chunks: int,
    *,
    needs_target: bool,
    ready: Callable[[], None] | None = None,
    same_count: bool = False,
) -> RankShare:
    """This rank's share of a step: cell 0's rank needs `input` (and tells the others its
    batch size), the last cell's rank `target` when `needs_target`; the others may pass
    None. Refuses a step after a failed one, and one that `ready` raises for."""
    groups.check_usable()
    first, last = layout.is_local(0), layout.is_local(layout.stages - 1)
    # A bad argument or a rank that cannot run is every rank's failed step, with its cause,
    # not a wait until the timeout (or the end of the refusing rank's process).
    refusal: BaseException | None = None
    given: tuple[Tensor, ...] = ()
    try:
        if ready is not None:
            ready()
        if first and input is None:
            raise ValueError(f"input: rank {layout.pp_index} runs cell 0 and needs it")
        if needs_target and last and target is None:
            raise ValueError(f"target: rank {layout.pp_index} runs the last cell and needs it")
        given = as_tensors(input, "input") if first else ()
        size = batch_size(given, "input") if first else None
    except BaseException as error:
        report(error)
        if groups.agrees_over_rings:
            raise  # its rings are closed: its peers' waits end
        refusal, size = error, None
    try:  # over the process group, a refusing rank takes part too (see ProcessGroups.batch)
        agreed = chunks if same_count else None
        batch, total = groups.batch(size, refused=refusal is not None, chunks=agreed)
    except BaseException as error:
        if refusal is None:
            report(error)
            raise
        raise refusal from None
    if refusal is not None:
        raise refusal
    count = len(split_sizes(batch, chunks))
    with torch.no_grad():
        microbatches = scatter(input, chunks) if first and input is not None else []
        targets = scatter_target(target, batch, chunks) if needs_target and last else [None] * count
    return RankShare(given, microbatches, targets, batch, total)


class CrossProcess:
    """The cross-process driver of one pipe: what every rank does around its own run of a
    step's schedule. `report` tells the other ranks of a failure here (so their waits end)."""

    def __init__(
        self,
        layout: ProcessLayout,
        groups: ProcessGroups,
        tied: TiedGradients | None,
        report: Callable[[BaseException], None],
        ready: Callable[[], None] | None = None,
    ) -> None:
        self.layout = layout
        self.groups = groups
        self.tied = tied
        self.report = report
        self.ready = ready  # raises when this rank cannot run a step (see rank_share)
        # Sharded stages: the replicas must split their batches into as many micro-batches,
        # and their reduce-scatters already summed the replicas' gradients.
        self.sharded = False

    def share(
        self, input: Value | None, target: Any, chunks: int, *, needs_target: bool
    ) -> RankShare:
        """This rank's share of a step (see rank_share)."""
        return rank_share(
            self.layout, self.groups, self.report, input, target, chunks,
            needs_target=needs_target, ready=self.ready, same_count=self.sharded,
        )  # fmt: skip

    def run(
        self, run: Callable[[], Tensor | None], transport: Transport, *, backward: bool
    ) -> Tensor | None:
        """Runs this rank's schedule (`run`) and waits for its sends; after a `backward`,
        the tied parameters' gradients are summed across the pipeline group and over the
        replicas. A failure is told to every rank. This rank's losses (None without the
        last cell, or without loss tasks)."""
        groups = self.groups
        try:
            if self.tied:
                self.tied.before_step()
            local = run()
            transport.finish()
            if backward and self.tied:
                self.tied.after_backward(groups.guard, groups.device)
                if self.layout.dp_group is not None and not self.sharded:
                    sum_gradients(
                        self.tied.local_tensors(),
                        self.layout.dp_group,
                        groups.guard,
                        "the tied parameters' gradients from the other replicas",
                    )
        except BaseException as error:
            self.report(error)
            raise
        return local

    def loss(self, local: Tensor | None) -> Tensor:
        """The whole batch's loss on every rank, from the last cell's rank."""
        try:
            return self.groups.loss(local)
        except BaseException as error:
            self.report(error)
            raise

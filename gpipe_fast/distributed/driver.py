"""The cross-process side of a pipe's steps: this rank's part, and what it does around a run.

The ranks agree on the batch, a failure reaches every rank, sends are awaited, tied,
replicated and sharded gradients are summed, and every rank gets the loss. In one process
the step path's other side (runtime/one_process.py) does none of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe_fast.device.streams import CellStreams
from gpipe_fast.distributed.grad_reduce import sum_gradients
from gpipe_fast.distributed.held_gradients import summing_this_step_only
from gpipe_fast.distributed.host_peers import HostPeers
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.distributed.process_groups import ProcessGroups, pipe_guard
from gpipe_fast.distributed.sharded import Sharding
from gpipe_fast.distributed.sync_copies import broadcast_replicas, broadcast_ties
from gpipe_fast.errors import SignatureChanged
from gpipe_fast.nn.items import Counting, count_items, step_items
from gpipe_fast.nn.microbatch import (
    BatchShare,
    Value,
    as_tensors,
    batch_size,
    scatter,
    scatter_target,
    split_sizes,
)
from gpipe_fast.nn.signature import input_signature
from gpipe_fast.nn.tied import TiedGradients
from gpipe_fast.skip.layout import SkipLayout
from gpipe_fast.transport.processes.across import skips_between_ranks
from gpipe_fast.transport.processes.registry import PipeMedia, make_transport, open_media
from gpipe_fast.transport.protocol import Transport


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
    counting: Counting | None = None,
    signature: int | None = None,
) -> BatchShare:
    """This rank's share of a step: cell 0's rank needs `input` (and tells the others its
    batch size), the last cell's rank `target` when `needs_target`; the others may pass
    None. Refuses a step after a failed one, and one that `ready` raises for. With
    `counting`, the items of the micro-batches are counted where they are (cell 0's input or
    the last cell's target) and agreed on (see ProcessGroups.items). With `signature` (the
    input signature the step expects), cell 0's rank tells its input's with the batch size,
    and every rank raises SignatureChanged when it is another, before any other message."""
    groups.check_usable()
    first, last = layout.is_local(0), layout.is_local(layout.stages - 1)
    # A bad argument or a rank that cannot run is every rank's failed step, with its cause,
    # not a wait until the timeout (or the end of the refusing rank's process).
    refusal: BaseException | None = None
    # Every rank sends a signature when one is expected (a refusing one too, so that the
    # messages match): cell 0's rank its input's, the others 0.
    local_signature = None if signature is None else 0
    given: tuple[Tensor, ...] = ()
    microbatches: list[Value] = []
    counted: list[int] | None = None
    try:
        if ready is not None:
            ready()
        if first and input is None:
            raise ValueError(f"input: rank {layout.pp_index} runs cell 0 and needs it")
        if needs_target and last and target is None:
            raise ValueError(f"target: rank {layout.pp_index} runs the last cell and needs it")
        given = as_tensors(input, "input") if first else ()
        size = batch_size(given, "input") if first else None
        if signature is not None and first:
            local_signature = input_signature(given)
        if counting is not None:
            counted = _count_here(counting, input, target, chunks, first=first, last=last)
    except BaseException as error:
        report(error)
        if groups.agrees_over_rings:
            raise  # its rings are closed: its peers' waits end
        refusal, size = error, None
    try:  # over the process group, a refusing rank takes part too (see ProcessGroups.batch)
        agreed = chunks if same_count else None
        batch, total, agreed_signature = groups.batch(
            size, refused=refusal is not None, chunks=agreed, signature=local_signature
        )
    except BaseException as error:
        if refusal is None:
            report(error)
            raise
        raise refusal from None
    if refusal is not None:
        raise refusal
    if agreed_signature is not None and agreed_signature != signature:
        raise SignatureChanged(agreed_signature)  # on every rank, each at the same message
    count = len(split_sizes(batch, chunks))
    items = None
    if counting is not None:
        try:
            if counting.source == "target" and counted is None:
                counted = [0] * count  # the target is the last cell's rank's
            local, counted_total = groups.items(
                counted, count, from_first=counting.source == "input"
            )
            if local is not None:
                items = step_items(local, counted_total, counting.given)
        except BaseException as error:
            report(error)
            raise
    with torch.no_grad():
        if first and input is not None:
            microbatches = scatter(input, chunks)
        targets = scatter_target(target, batch, chunks) if needs_target and last else [None] * count
    return BatchShare(given, microbatches, targets, batch, total, items)


def _count_here(
    counting: Counting, input: Value | None, target: Any, chunks: int, *, first: bool, last: bool
) -> list[int] | None:
    """The items this rank counts, before the batch is agreed: those of cell 0's input, or
    of the last cell's target (split by its own size: a size that differs from the input's
    is refused once the batch is agreed); None where it counts none."""
    if counting.count is None:
        return None
    if counting.source == "input" and first and input is not None:
        with torch.no_grad():
            return count_items(counting.count, scatter(input, chunks))
    if counting.source == "target" and last and target is not None:
        size = batch_size(as_tensors(target, "target"), "target")
        with torch.no_grad():
            return count_items(counting.count, scatter_target(target, size, chunks))
    return None


class CrossProcess:
    """This rank's part of a pipe across processes (or of one replica among several): the
    guard of its waits and its groups, its media to the other ranks, the replicas' gradient
    reductions and sharding, and what every rank does around its own run of a step.
    `modules`: this process's cells by stage (None: another process's cell)."""

    def __init__(
        self,
        layout: ProcessLayout,
        groups: ProcessGroups,
        media: PipeMedia,
        modules: Sequence[nn.Module | None],
        tied: TiedGradients | None,
        skips: SkipLayout | None,
        ready: Callable[[], None] | None = None,
    ) -> None:
        self.layout = layout
        self.groups = groups
        self.media = media
        self.modules = list(modules)
        self.tied = tied
        self.ready = ready  # raises when this rank cannot run a step (see rank_share)
        # The skip pairs sent between this pipe's ranks, found once for every step's transport.
        self.skips_between_ranks = skips_between_ranks(layout, skips)
        # Sharded stages (FSDP2, see shard): their replicas must split their batches into as
        # many micro-batches, and their reduce-scatters sum the replicas' gradients.
        self.sharding: Sharding | None = None

    @classmethod
    def open(
        cls,
        layout: ProcessLayout,
        device: torch.device,
        hosts: HostPeers | None,
        timeout_s: float,
        modules: Sequence[nn.Module | None],
        tied: TiedGradients | None,
        skips: SkipLayout | None,
        ready: Callable[[], None] | None = None,
    ) -> CrossProcess:
        """Every rank's part, built at the pipe's build on every rank: the guard, the media
        between the pipeline group's processes (chosen once), then the groups, which take
        the step's agreed values over the rings when these carry them."""
        guard = pipe_guard(timeout_s, hosts)
        media = open_media(layout, hosts, guard, device, skips)
        groups = ProcessGroups(layout, device, guard, media.control)
        return cls(layout, groups, media, modules, tied, skips, ready)

    def report(self, error: BaseException) -> None:
        """Tells the other processes of a failure here at once, so that their waits end: the
        failure goes to the store, then this rank's rings close."""
        guard = self.groups.guard
        guard.report(f"{type(error).__name__}: {error}")
        self.media.fail(f"rank {guard.rank}'s step failed")

    def make_transport(self, streams: CellStreams, devices: Sequence[torch.device]) -> Transport:
        """A step's transport across the pipeline group's processes, over the pipe's media."""
        return make_transport(
            streams, devices, self.layout, self.groups.guard, self.media, self.skips_between_ranks
        )

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
        """This rank's share of a step (see rank_share)."""
        return rank_share(
            self.layout, self.groups, self.report, input, target, chunks,
            needs_target=needs_target, ready=self.ready, same_count=self.sharding is not None,
            counting=counting, signature=signature,
        )  # fmt: skip

    @contextmanager
    def running(self, *, backward: bool) -> Iterator[None]:
        """Around this rank's part of a step (its schedule, its sends awaited and, after a
        `backward`, after_backward), telling every rank of a failure. A backward's sums
        across ranks see this step's gradients only; sharded cells start every step resharded
        and end it checked (the replicas ran the same tasks) and resharded."""
        sharding = self.sharding
        if sharding is not None:
            sharding.start_step()
        held: AbstractContextManager[None] = (
            summing_this_step_only(self.summed_across_ranks()) if backward else nullcontext()
        )
        with held:
            try:
                yield
            except BaseException as error:
                self.report(error)
                raise
        if sharding is not None:
            try:
                sharding.check_order()
                sharding.reshard()
            except BaseException as error:
                self.report(error)
                raise

    def before_step(self) -> None:
        """Each tie's device replicas made equal to its tensor here."""
        if self.tied:
            self.tied.before_step()

    def interrupt(self) -> None:
        """Ctrl-C stopped this rank's run: every rank is told at once, as of a failure, so
        that the other ranks' waits end, and so do this rank's own (which end its tasks)."""
        self.report(KeyboardInterrupt("interrupted (Ctrl-C)"))

    def after_backward(self) -> None:
        """What a backward leaves to sum once every cell's is done: the tied parameters'
        gradients across the pipeline group, then (replicated) over the replicas."""
        if not self.tied:
            return
        groups = self.groups
        self.tied.after_backward(groups.guard, groups.device)
        if self.layout.dp_group is not None and self.sharding is None:
            sum_gradients(
                self.tied.local_tensors(),
                self.layout.dp_group,
                groups.guard,
                "the tied parameters' gradients from the other replicas",
            )

    def loss(self, local: Tensor | None) -> Tensor:
        """The whole batch's loss on every rank, from the last cell's rank."""
        try:
            return self.groups.loss(local)
        except BaseException as error:
            self.report(error)
            raise

    def reduce_gradients(self, stage: int) -> None:
        """Stage `stage`'s gradients summed over the data-parallel group, as its backward
        ends (replicated cells)."""
        module = self.modules[stage]
        assert module is not None, f"cell {stage} runs in another process"
        # A tied parameter is left to after the backward, once (several cells hold it).
        tied = self.tied.members if self.tied else set()
        sum_gradients(
            [p for p in module.parameters() if id(p) not in tied],
            self.layout.dp_group,
            self.groups.guard,
            f"cell {stage}'s gradients from the other replicas",
        )

    def summed_across_ranks(self) -> list[Tensor]:
        """The tensors whose gradients a step sums across ranks: with replicated dp_group,
        every learning parameter of this process's cells (a tie's tensor once, not its
        replicas on other devices, which are added into it first); else the tied weights'
        copies."""
        tied = self.tied.local_tensors() if self.tied else []
        if self.layout.dp_group is None or self.sharding is not None:
            summed = tied if self.layout.multi_process else []
        else:
            members = self.tied.members if self.tied else set()
            own = [
                p
                for module in self.modules
                if module is not None
                for p in module.parameters()
                if id(p) not in members
            ]
            summed = own + tied
        return [t for t in summed if t.requires_grad]

    def sync_copies(self) -> None:
        """Every copy of a weight starts equal: tied copies across the pipeline group, then
        every tensor across the data-parallel replicas (sync_copies.py)."""
        guard = self.groups.guard
        if self.tied and self.layout.multi_process:
            broadcast_ties(self.tied, self.layout, guard, self.groups.device)
        if self.layout.dp_group is not None:
            modules = [m for m in self.modules if m is not None]
            broadcast_replicas(modules, self.layout.dp_group, guard)

    def shard(
        self,
        devices: Sequence[torch.device],
        *,
        sync: str,
        reshard_after_forward: bool,
        split: bool,
        timeout_s: float,
    ) -> Sharding:
        """Shards every local cell over the data-parallel group (after sync_copies: each
        replica keeps its share of the same weights); the tied copies become shards too."""
        dp = self.layout.dp_group
        assert dp is not None, "sharding needs a dp_group"
        self.sharding = Sharding(
            self.modules, devices, dp, sync=sync, reshard_after_forward=reshard_after_forward,
            split=split, timeout_s=timeout_s, guard=self.groups.guard,
        )  # fmt: skip
        if self.tied:
            self.tied.refresh(self.modules, (dist.get_world_size(dp), dist.get_rank(dp)))
        return self.sharding

    def close(self) -> None:
        """Closes the media and the guard's helper threads (one pipe's worth per pipe)."""
        self.media.close()
        self.groups.close()

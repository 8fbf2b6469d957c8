"""What a train_step adds across processes: agreeing on the batch, and the loss every rank gets."""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d as c10d

from gpipe_fast.distributed.guard import Guard
from gpipe_fast.distributed.host_peers import HostPeers
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.distributed.shm_links import (
    BATCH_TAG,
    ITEMS_TAG,
    LOSS_TAG,
    SIGNATURE_TAG,
    ShmLinks,
)
from gpipe_fast.errors import PeerFailure
from gpipe_fast.nn.microbatch import split_sizes
from gpipe_fast.transport.wire import DTYPES

# Pipes are built in the same order on every rank: their number keys their store entries.
_PIPES = itertools.count()

FAILED_STEP_ADVICE = (
    "after a failed step the process group may still hold messages of that step: destroy it "
    "(torch.distributed.destroy_process_group()) and restart the job from its last checkpoint"
)


def _attempt() -> str:
    """Which attempt of the job this is: torchrun restarts a failed job with the same store
    (by default), where the failed attempt's failure must not end the new attempt's steps."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def pipe_guard(timeout_s: float, hosts: HostPeers | None = None) -> Guard:
    """The guard of one pipe's waits across processes, keyed in the default store by the
    pipe's number (pipes are built in the same order on every rank) and the job's attempt."""
    return Guard(
        c10d._get_default_store(),
        f"gpipe_fast/attempt{_attempt()}/pipe{next(_PIPES)}",
        dist.get_rank(),
        timeout_s,
        peers=dist.get_world_size() - 1,
        processes=hosts.liveness() if hosts is not None else None,
        hosts_store=_hosts_store(),
    )


def _hosts_store() -> bool:
    """Whether this process hosts the default store's server: rank 0's does, as
    init_process_group's env:// and tcp:// start it, unless torchrun's agent hosts it."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.get_rank() == 0 and not agent


class ProcessGroups:
    """A pipe's steps across processes: the guard of their waits and what the ranks agree on.
    `links`: the pipe's rings when they carry the step's agreed values (every rank on this
    host): the batch size and the loss go through them instead of two broadcasts."""

    def __init__(
        self,
        layout: ProcessLayout,
        device: torch.device,
        guard: Guard,
        links: ShmLinks | None = None,
    ) -> None:
        self.layout = layout
        self.device = device
        self.guard = guard
        self.links = links

    def close(self) -> None:
        self.guard.close()

    def check_usable(self) -> None:
        """Starts a step: refuses it after one failed anywhere (see FAILED_STEP_ADVICE). A
        failure of this very step (another rank may be ahead: nothing holds the ranks together
        at a step's start over shared memory) ends it as a failure during it would."""
        self.guard.step += 1
        message = self.guard.failure()
        if message is None:
            return
        if self.guard.failed_step < self.guard.step:
            raise PeerFailure(
                f"gpipe_fast: an earlier step failed on {message}; {FAILED_STEP_ADVICE}"
            )
        if not self.agrees_over_rings:
            # Over the process group, no rank gets past the step's first all-reduce alone:
            # this step's failure is a rank's refusal, which takes part in it and is raised
            # there (see batch); leaving it now would leave that all-reduce pending.
            return
        raise PeerFailure(f"gpipe_fast: the step failed on {message}")

    def reduce_over_pipeline(self, value: Tensor, op: str) -> None:
        """`value` summed ("sum") or maximised ("max") over the pipeline group, in place."""
        if self.layout.multi_process:
            self._reduce(value, op, self.layout.pp_group)

    def reduce_over_all(self, value: Tensor, op: str) -> None:
        """`value` summed or maximised over every rank of the pipe: the pipeline group, then
        the data-parallel replicas, in place."""
        self.reduce_over_pipeline(value, op)
        if self.layout.dp_group is not None:
            self._reduce(value, op, self.layout.dp_group)

    def _reduce(
        self, value: Tensor, op: str, group: Any, what: str = "a value every rank agrees on"
    ) -> None:
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        request = dist.all_reduce(value, reduce_op, group=group, async_op=True)
        self.guard.wait(request, what, group=group)

    def _broadcast(self, value: Tensor, source: int, tag: int, what: str) -> None:
        """`value` from global rank `source` to the pipeline group, in place: over the rings'
        control lane when they carry it, else a broadcast of the group."""
        if self.links is not None:
            ranks = self.layout.pp_ranks
            self.links.broadcast(value, source, ranks, tag, self.guard, what)
            return
        request = dist.broadcast(value, source, group=self.layout.pp_group, async_op=True)
        self.guard.wait(request, what, source, self.layout.pp_group)

    @property
    def agrees_over_rings(self) -> bool:
        """Whether the step's agreed values travel over the rings' control lane."""
        return self.links is not None

    def batch(
        self,
        local: int | None,
        refused: bool = False,
        chunks: int | None = None,
        signature: int | None = None,
    ) -> tuple[int, int, int | None]:
        """(this pipeline's batch size, the batch over every data-parallel replica, cell 0's
        input signature or None): the rank of cell 0 tells the others its input's size;
        replicas add theirs up.

        With `signature` (every rank passes one, cell 0's rank its input's, the others 0; no
        replicas) the same message carries cell 0's: an "auto" pipe's steps then learn a new
        input signature without a message of their own (see ProcessGroups.signature).

        Over the process group, every rank takes part even when it `refused` the step (its
        cause already reported), and says so in the same all-reduce: then no rank starts a
        step that another will not run, whose messages would stay pending in the group (and
        a later destruction of the group would wait for them for ever). Every rank raises:
        the refusing one its own error (the caller's), the others PeerFailure naming it.
        (Over the rings a refusing rank closes them instead, which ends its peers' waits.)

        With `chunks` (sharded stages, whose replicas must run the same tasks), the replicas
        also agree that their batches split into as many micro-batches, in the same
        all-reduce; ValueError on every rank when they do not."""
        if signature is not None and self.layout.dp_group is not None:
            raise ValueError("signature: replicas agree on theirs with ProcessGroups.signature")
        # [the batch size (cell 0's rank, others 0), ranks that refused the step, and cell 0's
        # input signature when asked (others 0)]
        values = [local or 0, int(refused)] + ([] if signature is None else [signature])
        message = torch.tensor(values, dtype=torch.int64, device=self.device)
        if self.layout.multi_process:
            if self.agrees_over_rings:
                self._broadcast(message, self.layout.global_rank(0), BATCH_TAG, "the batch size")
                message[1] = int(refused)  # the source's refusal closed its rings instead
            else:
                self._reduce(message, "sum", self.layout.pp_group, "the batch size")
        size = int(message[0].item())
        if self.layout.dp_group is not None:
            if chunks is not None:
                # + [count, its square, 1]: the counts are equal iff n * sum(c^2) = sum(c)^2.
                count = len(split_sizes(size, chunks))
                message = torch.cat([message, message.new_tensor([count, count * count, 1])])
            self._reduce(message, "sum", self.layout.dp_group, "the replicas' batch sizes")
        if message[1] > 0 and not refused:
            self.guard.check()  # the refusing rank reported its cause before taking part
            raise PeerFailure("gpipe_fast: the step failed on another rank, which refused it")
        if chunks is not None and self.layout.dp_group is not None and not refused:
            counts, squares, replicas = (int(v) for v in message[2:].tolist())
            if squares * replicas != counts * counts:
                raise ValueError(
                    f"dp_shard: the replicas' batches split into different numbers of "
                    f"micro-batches (chunks={chunks}; this replica's {size} rows make "
                    f"{len(split_sizes(size, chunks))}): sharded stages must run the same "
                    f"tasks on every replica; give each replica at least {chunks} rows"
                )
        agreed = None if signature is None else int(message[2].item())
        return size, int(message[0].item()), agreed

    def items(
        self, counted: list[int] | None, count: int, *, from_first: bool
    ) -> tuple[list[int] | None, int]:
        """The items of a step's `count` micro-batches, for a loss that averages over counted
        items: (this replica's per micro-batch, their total over every replica).

        `from_first`: cell 0's rank counted them in its input (a model's labels; `counted`
        None: the input holds none, and every rank gets None); it tells the others. Else each
        rank gives its own (the last cell's rank counted its target; the others give zeros).
        The replicas add their totals up, and must all count items or none (ValueError)."""
        local = counted
        if from_first and self.layout.multi_process:
            # [whether the input holds items, then the items of each micro-batch]
            message = torch.zeros(1 + count, dtype=torch.int64, device=self.device)
            if counted is not None:
                message[0] = 1
                message[1:] = torch.tensor(counted, dtype=torch.int64)
            if self.agrees_over_rings:
                source = self.layout.global_rank(0)
                self._broadcast(message, source, ITEMS_TAG, "the items of the loss")
            else:
                self._reduce(message, "sum", self.layout.pp_group, "the items of the loss")
            local = message[1:].tolist() if message[0] > 0 else None
        total = sum(local) if local is not None else 0
        if self.layout.dp_group is not None:
            message = torch.tensor(
                [total, int(local is not None)], dtype=torch.int64, device=self.device
            )
            self._reduce(message, "sum", self.layout.dp_group, "the replicas' items")
            total, holding = (int(v) for v in message.tolist())
            if holding not in (0, dist.get_world_size(self.layout.dp_group)):
                raise ValueError(
                    "labels: some replicas' inputs hold labels and others' do not, so the "
                    "loss would average over items on some and over rows on others; give "
                    "every replica labels, or none"
                )
        return local, total

    def signature(self, local: int) -> int:
        """A step's input signature on every rank (a pipe built with "auto" tunes at a new
        one): cell 0's rank tells the others its `local` one; replicas take the largest."""
        message = torch.tensor([local], dtype=torch.int64, device=self.device)
        if self.layout.multi_process:
            source = self.layout.global_rank(0)
            self._broadcast(message, source, SIGNATURE_TAG, "the input's signature")
        if self.layout.dp_group is not None:
            self._reduce(message, "max", self.layout.dp_group, "the replicas' input signatures")
        return int(message.item())

    def loss(self, local: Tensor | None) -> Tensor:
        """The loss of the whole batch on every rank, in the last cell's dtype: the last
        cell's rank tells the others; replicas' losses (already weighted by their share) add
        up."""
        # [loss, dtype code] in float64: one message carries both.
        message = torch.zeros(2, dtype=torch.float64, device=self.device)
        if local is not None:
            message[0] = local.detach().to(torch.float64)
            message[1] = float(DTYPES.index(local.dtype))
        if self.layout.multi_process:
            source = self.layout.global_rank(self.layout.stages - 1)
            self._broadcast(message, source, LOSS_TAG, "the loss")
        code = int(message[1].item())
        if self.layout.dp_group is not None:
            message[1] = 0.0
            request = dist.all_reduce(message, group=self.layout.dp_group, async_op=True)
            self.guard.wait(request, "the replicas' losses", group=self.layout.dp_group)
        return message[0].to(DTYPES[code])

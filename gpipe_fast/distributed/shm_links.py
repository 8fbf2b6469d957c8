"""A pipe's same-host channels: a shared-memory ring per sending rank, receiving rank and lane."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gpipe_fast import _C
from gpipe_fast.distributed.guard import Guard
from gpipe_fast.distributed.host_peers import HostPeers
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.skip.layout import SkipLayout
from gpipe_fast.transport.choice import TransportChoice
from gpipe_fast.transport.protocol import ACTIVATION, Flow

# GPIPE_FAST_TRANSPORT=gloo keeps CPU tensors on gloo even between ranks of one host.
ENV = "GPIPE_FAST_TRANSPORT"
# GPIPE_FAST_DEBUG_POISON=1: a debug mode (the test suite's) in which each ring overwrites
# every byte it has handed out, and each received message its bytes once it goes, with 0xFF
# (NaN in any float): a tensor still read from memory the transport reused shows at once.
POISON_ENV = "GPIPE_FAST_DEBUG_POISON"
# Room of each ring: a larger message streams through it (its sender's flusher thread).
RING_BYTES = 1 << 21
# Room of a control lane's ring (its messages are a few words).
CONTROL_RING_BYTES = 1 << 12
# How long a waiting side spins before it sleeps on its futex: busy for 20 us, then yielding
# the core between looks. A millisecond keeps the CPU of a rank waiting for its next message
# from going idle, whose wake-up (a virtual CPU's above all) cost 10-20 ms per step of 32
# micro-batches after a pause (bench/README.md, "spinning").
SPIN_US = 1000.0
SHARED_MEMORY = "shared memory"


# The lane of the values every rank of the pipe agrees on at each step (the batch size from
# cell 0's rank, the loss from the last cell's), when all its ranks share one host.
CONTROL = 2
# Their tags on that lane: one message of each per step, taken in the order sent (the items
# of a loss that averages over counted ones, from cell 0's rank, in the steps that count them;
# the input's signature only for pipes that tune themselves: see ProcessGroups.signature).
BATCH_TAG, LOSS_TAG, ITEMS_TAG, SIGNATURE_TAG = 0, 1, 2, 3


def lane(flow: Flow) -> int:
    """The ring of a flow: activations and skips on one, gradients and skips' gradients on
    the other, so that a message of either flow is never stuck behind the other's."""
    return 0 if flow == ACTIVATION else 1


class ShmLinks:
    """This rank's ends of its pipe's rings, by (peer's global rank, lane): it created the
    receiving ones, attached to the sending ones. Set up once per pipe, closed with it."""

    def __init__(
        self,
        senders: dict[tuple[int, int], _C.ShmSender],
        receivers: dict[tuple[int, int], _C.ShmReceiver],
        rings: set[tuple[int, int, int]],
    ) -> None:
        self.senders = senders
        self.receivers = receivers
        # Every (sending position, receiving position, lane) of the group with a ring (the
        # same set on every rank; the control lane's apart).
        self.rings = rings

    def carries(self, sender: int, receiver: int, flow: Flow) -> bool:
        """Whether a ring carries `flow` from group position `sender` to `receiver`."""
        return (sender, receiver, lane(flow)) in self.rings

    def sender(self, peer: int, flow: Flow) -> _C.ShmSender | None:
        return self.senders.get((peer, lane(flow)))

    def receiver(self, peer: int, flow: Flow) -> _C.ShmReceiver | None:
        return self.receivers.get((peer, lane(flow)))

    @property
    def carries_control(self) -> bool:
        """Whether the step's agreed values travel here (every rank of the pipe on this host)."""
        return any(lane == CONTROL for _, lane in (*self.senders, *self.receivers))

    def broadcast(
        self, value: torch.Tensor, source: int, ranks: Sequence[int], tag: int, guard: Guard,
        what: str,
    ) -> None:  # fmt: skip
        """`value` (a small contiguous CPU tensor) from global rank `source` to the others of
        `ranks`, in place, over the control lane: the source sends it to each, which wait for
        it (bounded by `guard`, like any receive)."""
        me = guard.rank
        if me == source:
            part = [(value.data_ptr(), value.numel() * value.element_size())]
            for peer in ranks:
                if peer != me:
                    try:
                        self.senders[(peer, CONTROL)].send(tag, part)
                    except ConnectionError as error:
                        guard.check()
                        channel = f"its channel to rank {peer} ({what})"
                        raise guard.lost(channel, None, error, (peer,)) from error
            return
        ring = self.receivers[(source, CONTROL)]
        message = guard.poll(lambda seconds: ring.receive(tag, seconds), what, source)
        value.copy_(torch.frombuffer(message, dtype=value.dtype, count=value.numel()))

    def fail(self, reason: str) -> None:
        """This rank's step failed: closes the rings it sends on, so that a peer waiting for
        its messages stops at once. Those it receives on stay open: its own waits learn of
        the failure from the store (or from the peers closing theirs), after the failing
        task's own error has ended the step, so that this rank raises that one."""
        for sender in self.senders.values():
            sender.close(reason, True)

    def release(self) -> None:
        """Closes every ring (what one holds is still read by its receiver) and lets their
        memory go: the pipe is closed."""
        for sender in self.senders.values():
            sender.close("the pipe was closed", False)
        for receiver in self.receivers.values():
            receiver.close("the pipe was closed", False)
        self.senders.clear()
        self.receivers.clear()


def routes(layout: ProcessLayout, skips: SkipLayout | None) -> set[tuple[int, int, int]]:
    """Every (sending position, receiving position, lane) of the pipeline group that carries
    messages: a boundary between cells of two ranks (activations one way, gradients back),
    and a skip pair between two ranks (skips, their gradients back). The same on every rank."""
    pairs = [(k, k + 1) for k in range(layout.stages - 1)]
    pairs += list(skips.pairs()) if skips else []
    found = set()
    for first, second in pairs:
        a, b = layout.stage_rank(first), layout.stage_rank(second)
        if a != b:
            found |= {(a, b, 0), (b, a, 1)}
    return found


def control_routes(layout: ProcessLayout) -> set[tuple[int, int, int]]:
    """The control lane's (sending position, receiving position, lane): from the rank of
    cell 0 (the batch size) and from the rank of the last cell (the loss) to every other."""
    sources = {layout.stage_rank(0), layout.stage_rank(layout.stages - 1)}
    return {(s, r, CONTROL) for s in sources for r in range(layout.pp_size) if r != s}


def _ring_name(token: int, sender: int, receiver: int, lane: int) -> str:
    return f"/gpf-{token:016x}-s{sender}-r{receiver}-l{lane}"


def connect(
    layout: ProcessLayout,
    hosts: HostPeers,
    guard: Guard,
    device: torch.device,
    skips: SkipLayout | None,
) -> tuple[ShmLinks | None, TransportChoice]:
    """The pipe's rings between the ranks of its pipeline group that share a host, when its
    cells run on the CPU (None otherwise), and the choice made. Every rank of the group calls
    it, at the pipe's build: the ranks agree (two small all-reduces) on shared memory, or on
    the process group's backend for all when any of them cannot (GPIPE_FAST_TRANSPORT=gloo,
    or no room for the rings)."""
    if not layout.multi_process:
        return None, TransportChoice("in process", "every cell of the pipe runs in this process")
    backend = str(dist.get_backend(layout.pp_group))
    if device.type != "cpu":
        return None, TransportChoice(
            backend, f"the cells run on {device.type}: shared memory carries CPU tensors only"
        )
    choice = os.environ.get(ENV, "").strip().lower()
    # 0: shared memory where it can, 1: the backend, 2: a value this rank cannot read.
    wants = {"": 0, "auto": 0, "gloo": 1}.get(choice, 2)
    ranks = layout.pp_ranks
    every = routes(layout, skips)
    rings = {(s, r, n) for s, r, n in every if hosts.same_host(ranks[s], ranks[r])}
    if not rings:
        if wants == 2:
            raise _bad_choice(choice)
        return None, TransportChoice(backend, "no two ranks that exchange tensors share a host")
    me = layout.pp_index
    # Agreed by every rank: whether any wants the backend, and the rings' names (a random
    # token of the group's first rank: unique per job, pipe and attempt).
    token = int.from_bytes(os.urandom(8), "big") >> 1 if me == 0 else 0
    agreed = torch.tensor([wants, token], dtype=torch.int64)
    _all_max(agreed, layout, guard, "the ranks' choice of transport")
    if agreed[0] == 2:  # every rank raises, not only the one with the bad value
        raise _bad_choice(choice if wants == 2 else None)
    if agreed[0]:
        where = "on this rank" if choice == "gloo" else "on another rank of the pipe"
        return None, TransportChoice(backend, f"{ENV}=gloo {where}")
    token = int(agreed[1])
    # Every rank on this host: the values agreed at each step travel over rings too.
    made = rings | (control_routes(layout) if rings == every else set())
    receivers: dict[tuple[int, int], _C.ShmReceiver] = {}
    poison = os.environ.get(POISON_ENV, "").strip() not in ("", "0")
    problem = ""
    try:
        for s, r, n in sorted(made):
            if r == me:
                name = _ring_name(token, ranks[s], ranks[r], n)
                room = CONTROL_RING_BYTES if n == CONTROL else RING_BYTES
                receivers[(ranks[s], n)] = _C.ShmReceiver(name, room, SPIN_US, poison)
    except (OSError, RuntimeError) as error:  # no room in /dev/shm, say
        problem = str(error).strip().splitlines()[0]
    failed = torch.tensor([int(bool(problem))], dtype=torch.int64)
    _all_max(failed, layout, guard, "the ranks' shared-memory rings")
    if failed[0]:
        receivers.clear()  # their names go with them: no sender attached
        where = f"this rank: {problem}" if problem else "another rank of the pipe"
        return None, TransportChoice(backend, f"shared-memory rings could not be made on {where}")
    senders = {
        (ranks[r], n): _C.ShmSender(_ring_name(token, ranks[s], ranks[r], n), guard.timeout_s,
                                    SPIN_US)
        for s, r, n in sorted(made)
        if s == me
    }  # fmt: skip
    for (peer, _), receiver in receivers.items():
        guard.poll(receiver.wait_attached, "its shared-memory ring to be attached", peer)
    links = ShmLinks(senders, receivers, rings)
    if rings == every:
        return links, TransportChoice(SHARED_MEMORY, "the pipe's ranks share this host")
    return links, TransportChoice(
        f"{SHARED_MEMORY} and {backend}",
        f"shared memory between ranks of one host, {backend} between hosts",
    )


def _bad_choice(choice: str | None) -> ValueError:
    """The error for an unknown GPIPE_FAST_TRANSPORT: this rank's value, or another rank's."""
    where = f"{ENV}={choice!r}" if choice is not None else f"{ENV} on another rank of the pipe"
    return ValueError(f"{where}: give 'gloo' (or leave it unset: shared memory between the "
                      "ranks of one host)")  # fmt: skip


def _all_max(value: torch.Tensor, layout: ProcessLayout, guard: Guard, what: str) -> None:
    request = dist.all_reduce(value, dist.ReduceOp.MAX, group=layout.pp_group, async_op=True)
    guard.wait(request, what, group=layout.pp_group)

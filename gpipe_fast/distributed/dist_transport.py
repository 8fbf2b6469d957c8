"""Boundary tensors between processes: a shared-memory message, or isend/irecv after a header."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe_fast.device.streams import CellStreams
from gpipe_fast.distributed.guard import Guard
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.distributed.shm_links import ShmLinks
from gpipe_fast.skip.layout import SkipLayout
from gpipe_fast.transport import wire
from gpipe_fast.transport.local import LocalTransport
from gpipe_fast.transport.protocol import ACTIVATION, Flow, Payload, Transport


class DistTransport:
    """A Transport across the processes of a pipeline group. A value for a stage of this
    process goes through the local mailbox; one for another process waits in the outbox
    until the send task posts it (send_forward / send_backward on the communication worker),
    and the receive task (recv_forward / recv_backward) fetches one into the mailbox. Each
    message is a fixed-size header (structure, dtypes, shapes: they may change between
    micro-batches and steps) then its tensors (a pytree other than a tensor or a tuple of
    tensors ends them with its structure and other leaves, pickled), tagged with its flow,
    boundary and micro-batch. Every wait is bounded by the guard.

    Between two ranks of one host on the CPU (`links`, the pipe's shared-memory rings) a
    message is the header and every tensor at once, in the ring of its flow; the receive
    task (on the compute worker that needs it: see ShmLinks.inline_ranks) waits for it
    itself, in slices between which it looks for another rank's failure, and views the
    tensors in the received bytes. Nothing is posted ahead
    (`expect`) and a send never waits: what does not fit in the ring is queued, and `finish`
    waits until it is in.

    Skip connections (`skips`) whose stash and pop stages sit on two processes travel the
    same way, one message per (stash stage, pop stage) pair and micro-batch holding that
    pair's skips in the layout's order, straight between the two processes: send_skips
    posts what a stash left, recv_skips fetches it before the popping forward, and their
    gradients go back with send_skip_grads / recv_skip_grads."""

    def __init__(
        self,
        local: LocalTransport,
        layout: ProcessLayout,
        guard: Guard,
        device: torch.device,
        skips: dict[tuple[int, int], list[Hashable]] | None = None,
        links: ShmLinks | None = None,
    ) -> None:
        self.local = local
        self.links = links
        self.layout = layout
        self.guard = guard
        self.device = device
        # Small tensors between CPU processes travel inside their header's message (one
        # round trip instead of two); NCCL's messages keep the header alone.
        self.inline_bytes = wire.INLINE_BYTES if device.type == "cpu" else 0
        self.outbox: dict[tuple[Flow, int, int], Payload] = {}
        # Headers whose receive was posted ahead (see expect): (flow, stage, m) -> request.
        self.headers: dict[tuple[Flow, int, int], tuple[Any, Tensor]] = {}
        # Sends posted and not yet known complete: (requests, what, peer); their tensors are
        # kept alive by the requests' buffers until then.
        self.sends: list[tuple[list[Any], list[Tensor], str, int]] = []
        # The skip pairs between processes (skips_between_ranks: the same on every rank),
        # numbered for their tags; the values send_skip left for another process:
        # (flow, sending stage, receiving stage, m, key) -> value.
        self.skip_pairs = skips or {}
        self.skip_tags = {pair: i for i, pair in enumerate(sorted(self.skip_pairs))}
        self.skip_outbox: dict[tuple[Flow, int, int, int, Hashable], Tensor | None] = {}

    # -- the Transport the stages call -------------------------------------------------------

    def send(self, flow: Flow, stage: int, microbatch: int, payload: Payload) -> None:
        receiver = stage + 1 if flow == ACTIVATION else stage - 1
        if self.layout.is_local(receiver):
            self.local.send(flow, stage, microbatch, payload)
        else:
            self.outbox[(flow, stage, microbatch)] = payload

    def deliver(self, flow: Flow, stage: int, microbatch: int, payload: Payload) -> None:
        self.local.deliver(flow, stage, microbatch, payload)

    def recv(self, flow: Flow, stage: int, microbatch: int) -> Payload:
        return self.local.recv(flow, stage, microbatch)

    def send_skip(
        self,
        flow: Flow,
        stage: int,
        receiver: int,
        microbatch: int,
        key: Hashable,
        tensor: Tensor | None,
    ) -> None:
        if self.layout.is_local(receiver):
            self.local.send_skip(flow, stage, receiver, microbatch, key, tensor)
        else:
            self.skip_outbox[(flow, stage, receiver, microbatch, key)] = tensor

    def recv_skip(self, flow: Flow, stage: int, microbatch: int, key: Hashable) -> Tensor | None:
        return self.local.recv_skip(flow, stage, microbatch, key)

    # -- the communication actions -----------------------------------------------------------

    def _tag(self, flow: Flow, boundary: int, microbatch: int) -> int:
        return (
            (0 if flow == ACTIVATION else 1) * self.layout.stages + boundary
        ) * 65536 + microbatch

    def _skip_tag(self, flow: Flow, pair: tuple[int, int], microbatch: int) -> int:
        # After the boundaries' tags: two per skip pair (its skips, their gradients).
        index = 2 * self.skip_tags[pair] + (0 if flow == ACTIVATION else 1)
        return (2 * self.layout.stages + index) * 65536 + microbatch

    def _what(self, flow: Flow, stage: int, microbatch: int) -> str:
        noun = "activation" if flow == ACTIVATION else "gradient"
        return f"the {noun} of cell {stage}, micro-batch {microbatch}"

    def _skip_what(self, flow: Flow, pair: tuple[int, int], microbatch: int) -> str:
        names = ", ".join(repr(key[1]) for key in self.skip_pairs[pair])  # type: ignore[index]
        noun = "skips" if flow == ACTIVATION else "skips' gradients"
        return (
            f"the {noun} {names} of cell {pair[0]} popped in cell {pair[1]}, "
            f"micro-batch {microbatch}"
        )

    def _send(self, payload: Payload, peer: int, tag: int, what: str, flow: Flow) -> None:
        """Posts `payload` to rank `peer`: its header, then its tensors unless inline (one
        message for both over shared memory)."""
        sender = self.links.sender(peer, flow) if self.links is not None else None
        if sender is not None:
            # `message` holds the bytes its parts point at (a non-contiguous tensor's copy
            # among them) until send() has copied them into the ring or its queue.
            message = wire.gather(payload)
            try:
                sender.send(tag, message.parts)
            except ConnectionError as error:
                self.guard.check()
                channel = f"its channel to rank {peer} (sending {what})"
                raise self.guard.lost(channel, None, error, (peer,)) from error
            return
        payload = wire.packed(payload)  # once, for the header and the tensors
        header = wire.encode(payload, self.device, self.inline_bytes)
        if wire.is_inline(header):
            buffers = [header]
        else:
            buffers = [header, *wire.tensors(payload, self.device)]
        group = self.layout.pp_group
        requests = [dist.isend(t, dst=peer, group=group, tag=tag) for t in buffers]
        self.sends.append((requests, buffers, what, peer))
        self._collect()

    def _post_header(self, peer: int, tag: int) -> tuple[Any, Tensor]:
        header = wire.empty_header(self.device, self.inline_bytes)
        return dist.irecv(header, src=peer, group=self.layout.pp_group, tag=tag), header

    def _receive(
        self,
        peer: int,
        tag: int,
        what: str,
        flow: Flow,
        posted: tuple[Any, Tensor] | None = None,
    ) -> Payload:
        """The payload rank `peer` sends with `tag` (its header's receive `posted` ahead, or
        posted now), once it is here."""
        receiver = self.links.receiver(peer, flow) if self.links is not None else None
        if receiver is not None:
            ring = receiver  # for the closure's type
            message = self.guard.poll(lambda seconds: ring.receive(tag, seconds), what, peer)
            # The header then each tensor at an aligned offset, as an inline message is laid
            # out: the tensors are views of the received bytes (they keep them alive).
            return wire.message(message)
        request, header = posted or self._post_header(peer, tag)
        self.guard.wait(request, what, peer)
        if wire.is_inline(header):  # the tensors came with it, laid out as over the rings
            return wire.message(header.numpy())
        kind, entries = wire.layout(header)
        tensors = [
            None if e is None else torch.empty(e[1], dtype=e[0], device=self.device)
            for e in entries
        ]
        group = self.layout.pp_group
        requests = [dist.irecv(t, src=peer, group=group, tag=tag) for t in tensors if t is not None]
        if requests:  # one hand-off to the guard's waiters for all of them
            self.guard.wait(requests, what, peer)
        return wire.assemble(kind, tensors)

    def _sender(self, flow: Flow, stage: int, microbatch: int) -> tuple[int, int]:
        """(rank, tag) of the message `stage` receives for `microbatch` in `flow`."""
        sender = stage - 1 if flow == ACTIVATION else stage + 1
        return self.layout.global_rank(sender), self._tag(flow, min(stage, sender), microbatch)

    def post(self, flow: Flow, stage: int, microbatch: int) -> None:
        """Sends what `stage` left in the outbox to the process of its neighbour."""
        payload = self.outbox.pop((flow, stage, microbatch))
        receiver = stage + 1 if flow == ACTIVATION else stage - 1
        peer = self.layout.global_rank(receiver)
        tag = self._tag(flow, min(stage, receiver), microbatch)
        self._send(payload, peer, tag, self._what(flow, stage, microbatch), flow)

    def expect(self, receives: Iterable[tuple[Flow, int, int]]) -> None:
        """Posts the header receive of each of the step's messages at once: a sender then
        delivers a header as soon as it posts it, and each receive waits only for its
        tensors (gloo moves a message once its receive is posted). Not over shared memory:
        a message waits in its ring until asked for."""
        for key in receives:
            peer, tag = self._sender(*key)
            if not self._over_shm(peer, key[0]):
                self.headers[key] = self._post_header(peer, tag)

    def fetch(self, flow: Flow, stage: int, microbatch: int) -> None:
        """Receives `stage`'s next value from its neighbour's process into the mailbox."""
        peer, tag = self._sender(flow, stage, microbatch)
        sender = stage - 1 if flow == ACTIVATION else stage + 1
        what = self._what(flow, sender, microbatch)
        posted = self.headers.pop((flow, stage, microbatch), None)
        payload = self._receive(peer, tag, what, flow, posted)
        self.local.deliver(flow, stage, microbatch, payload)

    def _skip_peers(self, flow: Flow, stage: int, *, sending: bool) -> list[tuple[int, int]]:
        """The skip pairs between processes that `stage` sends (or receives) in `flow`:
        forward, a stash sends to its pops; backward, a pop sends to its stashes."""
        end = 0 if (flow == ACTIVATION) == sending else 1
        return [pair for pair in sorted(self.skip_pairs) if pair[end] == stage]

    def post_skips(self, flow: Flow, stage: int, microbatch: int) -> None:
        """Sends what `stage` left for stages of other processes: one message per pair."""
        for pair in self._skip_peers(flow, stage, sending=True):
            receiver = pair[1] if flow == ACTIVATION else pair[0]
            payload = tuple(
                self.skip_outbox.pop((flow, stage, receiver, microbatch, key))
                for key in self.skip_pairs[pair]
            )
            peer = self.layout.global_rank(receiver)
            tag = self._skip_tag(flow, pair, microbatch)
            self._send(payload, peer, tag, self._skip_what(flow, pair, microbatch), flow)

    def fetch_skips(self, flow: Flow, stage: int, microbatch: int) -> None:
        """Receives what stages of other processes sent `stage` into the local mailbox:
        every pair's header posted at once, so that they may come in any order."""
        pairs = self._skip_peers(flow, stage, sending=False)
        senders = [pair[0] if flow == ACTIVATION else pair[1] for pair in pairs]
        tags = [self._skip_tag(flow, pair, microbatch) for pair in pairs]
        peers = [self.layout.global_rank(sender) for sender in senders]
        posted = [
            None if self._over_shm(peer, flow) else self._post_header(peer, tag)
            for peer, tag in zip(peers, tags, strict=True)
        ]
        for i, pair in enumerate(pairs):
            what = self._skip_what(flow, pair, microbatch)
            payload = self._receive(peers[i], tags[i], what, flow, posted[i])
            sender = senders[i]
            assert isinstance(payload, tuple), "skips travel as a tuple"
            for key, tensor in zip(self.skip_pairs[pair], payload, strict=True):
                self.local.send_skip(flow, sender, stage, microbatch, key, tensor)

    def _collect(self) -> None:
        """Forgets the sends that have completed (their buffers may go)."""
        self.sends = [s for s in self.sends if not all(r.is_completed() for r in s[0])]

    def _over_shm(self, peer: int, flow: Flow) -> bool:
        return self.links is not None and self.links.receiver(peer, flow) is not None

    def finish(self) -> None:
        """Waits for every send of the step to complete (at its end): over shared memory,
        until what its rings' senders queued is in the rings."""
        for (peer, _), sender in self.links.senders.items() if self.links is not None else ():
            if sender.queued_bytes:
                what = f"rank {peer} to take in this step's messages"
                self.guard.poll(sender.flush, what, suspects=(peer,))
        for requests, _buffers, what, peer in self.sends:
            self.guard.wait(requests, f"{what} to be received", peer)
        self.sends.clear()

    def discard(self) -> None:
        # The outboxes hold what was never sent; `sends` stays: its buffers are in flight.
        self.local.discard()
        self.outbox.clear()
        self.skip_outbox.clear()

    def pending(self) -> int:
        return self.local.pending() + len(self.outbox) + len(self.skip_outbox)


def skips_between_ranks(
    layout: ProcessLayout, skips: SkipLayout | None
) -> dict[tuple[int, int], list[Hashable]]:
    """The skip pairs whose stash and pop cells run on two ranks, (stash, pop) -> their keys
    in the layout's order: what a DistTransport sends as messages (found once per pipe)."""
    pairs = skips.pairs() if skips is not None else {}
    return {
        pair: list(keys)
        for pair, keys in pairs.items()
        if layout.stage_rank(pair[0]) != layout.stage_rank(pair[1])
    }


def make_transport(
    streams: CellStreams,
    devices: Sequence[torch.device],
    layout: ProcessLayout,
    guard: Guard | None,
    skips: dict[tuple[int, int], list[Hashable]] | None = None,
    links: ShmLinks | None = None,
) -> Transport:
    """A step's transport: in-process when every stage runs here, else across the pipeline
    group's processes (bounded by `guard`; over `links` where the pipe has a shared-memory
    ring), carrying the skip pairs between ranks (`skips`, see skips_between_ranks) too."""
    local = LocalTransport(streams, devices)
    if not layout.multi_process:
        return local
    assert guard is not None, "a transport across processes needs the pipe's guard"
    return DistTransport(local, layout, guard, devices[layout.local_stages[0]], skips, links)

"""Boundary tensors between processes: torch.distributed isend/irecv, each after its header."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe_fast.device.streams import CellStreams
from gpipe_fast.distributed.guard import Guard
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.transport import wire
from gpipe_fast.transport.local import LocalTransport
from gpipe_fast.transport.protocol import ACTIVATION, Flow, Payload, Transport


class DistTransport:
    """A Transport across the processes of a pipeline group. A value for a stage of this
    process goes through the local mailbox; one for another process waits in the outbox
    until the send task posts it (send_forward / send_backward on the communication worker),
    and the receive task (recv_forward / recv_backward) fetches one into the mailbox. Each
    message is a fixed-size header (structure, dtypes, shapes: they may change between
    micro-batches and steps) then its tensors, tagged with its flow, boundary and
    micro-batch. Every wait is bounded by the guard."""

    def __init__(
        self,
        local: LocalTransport,
        layout: ProcessLayout,
        guard: Guard,
        device: torch.device,
    ) -> None:
        self.local = local
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

    # -- the communication actions -----------------------------------------------------------

    def send_skip(
        self,
        flow: Flow,
        stage: int,
        receiver: int,
        microbatch: int,
        key: Hashable,
        tensor: Tensor | None,
    ) -> None:
        if not (self.layout.is_local(stage) and self.layout.is_local(receiver)):
            # GPipe refuses a pipe whose skips cross cells with pp_group before it runs.
            raise NotImplementedError(
                "gpipe_fast: skip connections between processes are not supported yet"
            )
        self.local.send_skip(flow, stage, receiver, microbatch, key, tensor)

    def recv_skip(self, flow: Flow, stage: int, microbatch: int, key: Hashable) -> Tensor | None:
        return self.local.recv_skip(flow, stage, microbatch, key)

    def _tag(self, flow: Flow, boundary: int, microbatch: int) -> int:
        return (
            (0 if flow == ACTIVATION else 1) * self.layout.stages + boundary
        ) * 65536 + microbatch

    def _what(self, flow: Flow, stage: int, microbatch: int) -> str:
        noun = "activation" if flow == ACTIVATION else "gradient"
        return f"the {noun} of cell {stage}, micro-batch {microbatch}"

    def post(self, flow: Flow, stage: int, microbatch: int) -> None:
        """Sends what `stage` left in the outbox to the process of its neighbour."""
        payload = self.outbox.pop((flow, stage, microbatch))
        receiver = stage + 1 if flow == ACTIVATION else stage - 1
        peer = self.layout.global_rank(receiver)
        tag = self._tag(flow, min(stage, receiver), microbatch)
        group = self.layout.pp_group
        header = wire.encode(payload, self.device, self.inline_bytes)
        buffers = [header] if wire.is_inline(header) else [header, *wire.tensors(payload)]
        requests = [dist.isend(t, dst=peer, group=group, tag=tag) for t in buffers]
        self.sends.append((requests, buffers, self._what(flow, stage, microbatch), peer))
        self._collect()

    def _post_header(self, flow: Flow, stage: int, microbatch: int) -> tuple[Any, Tensor]:
        sender = stage - 1 if flow == ACTIVATION else stage + 1
        peer = self.layout.global_rank(sender)
        tag = self._tag(flow, min(stage, sender), microbatch)
        header = wire.empty_header(self.device, self.inline_bytes)
        return dist.irecv(header, src=peer, group=self.layout.pp_group, tag=tag), header

    def expect(self, receives: Iterable[tuple[Flow, int, int]]) -> None:
        """Posts the header receive of each of the step's messages at once: a sender then
        delivers a header as soon as it posts it, and each receive waits only for its
        tensors (gloo moves a message once its receive is posted)."""
        for key in receives:
            self.headers[key] = self._post_header(*key)

    def fetch(self, flow: Flow, stage: int, microbatch: int) -> None:
        """Receives `stage`'s next value from its neighbour's process into the mailbox."""
        sender = stage - 1 if flow == ACTIVATION else stage + 1
        peer = self.layout.global_rank(sender)
        tag = self._tag(flow, min(stage, sender), microbatch)
        group = self.layout.pp_group
        what = self._what(flow, sender, microbatch)
        posted = self.headers.pop((flow, stage, microbatch), None)
        request, header = posted or self._post_header(flow, stage, microbatch)
        self.guard.wait(request, what, peer)
        is_tuple, entries = wire.layout(header)
        if wire.is_inline(header):  # the tensors came with it
            self.local.deliver(flow, stage, microbatch,
                               wire.assemble(is_tuple, wire.inline(header, entries)))  # fmt: skip
            return
        tensors = [
            None if e is None else torch.empty(e[1], dtype=e[0], device=self.device)
            for e in entries
        ]
        requests = [dist.irecv(t, src=peer, group=group, tag=tag) for t in tensors if t is not None]
        if requests:  # one hand-off to the guard's waiters for all of them
            self.guard.wait(requests, what, peer)
        self.local.deliver(flow, stage, microbatch, wire.assemble(is_tuple, tensors))

    def _collect(self) -> None:
        """Forgets the sends that have completed (their buffers may go)."""
        self.sends = [s for s in self.sends if not all(r.is_completed() for r in s[0])]

    def finish(self) -> None:
        """Waits for every send of the step to complete (at its end)."""
        for requests, _buffers, what, peer in self.sends:
            self.guard.wait(requests, f"{what} to be received", peer)
        self.sends.clear()

    def pending(self) -> int:
        return self.local.pending() + len(self.outbox)


def make_transport(
    streams: CellStreams,
    devices: Sequence[torch.device],
    layout: ProcessLayout,
    guard: Guard | None,
) -> Transport:
    """A step's transport: in-process when every stage runs here, else across the pipeline
    group's processes (bounded by `guard`)."""
    local = LocalTransport(streams, devices)
    if not layout.multi_process:
        return local
    assert guard is not None, "a transport across processes needs the pipe's guard"
    return DistTransport(local, layout, guard, devices[layout.local_stages[0]])

"""The process group's own medium: a header then the tensors, with torch.distributed isend/irecv."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe_fast.distributed.guard import Guard
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.transport import wire
from gpipe_fast.transport.processes.medium import Posted
from gpipe_fast.transport.protocol import Flow, Payload


class GroupMedium:
    """Carries any route, over the pipeline group's backend (gloo, NCCL): each message is a
    fixed-size header (structure, dtypes, shapes: they may change between micro-batches and
    steps), then its tensors (a pytree other than a tensor or a tuple of tensors ends them with
    its structure and other leaves, pickled), each an isend/irecv tagged by the transport.
    A receive's header can be posted ahead (the transport's `expect`): gloo moves a message
    once its receive is posted."""

    receives_inline = False

    def __init__(self, layout: ProcessLayout, guard: Guard, device: torch.device) -> None:
        self.group = layout.pp_group
        self.guard = guard
        self.device = device
        # Small tensors between CPU processes travel inside their header's message (one
        # round trip instead of two); NCCL's messages keep the header alone.
        self.inline_bytes = wire.INLINE_BYTES if device.type == "cpu" else 0
        # Sends posted and not yet known complete: (requests, buffers, what, peer); their
        # tensors are kept alive by the buffers until then.
        self.sends: list[tuple[list[Any], list[Tensor], str, int]] = []

    def carries(self, sender: int, receiver: int, flow: Flow) -> bool:
        return True

    def post_ahead(self, peer: int, tag: int) -> tuple[Any, Tensor]:
        header = wire.empty_header(self.device, self.inline_bytes)
        return dist.irecv(header, src=peer, group=self.group, tag=tag), header

    def send(self, payload: Payload, peer: int, tag: int, what: str, flow: Flow) -> None:
        """Posts the header, then the tensors unless they travel inside it."""
        payload = wire.packed(payload)  # once, for the header and the tensors
        header = wire.encode(payload, self.device, self.inline_bytes)
        if wire.is_inline(header):
            buffers = [header]
        else:
            buffers = [header, *wire.tensors(payload, self.device)]
        requests = [dist.isend(t, dst=peer, group=self.group, tag=tag) for t in buffers]
        self.sends.append((requests, buffers, what, peer))
        self._collect()

    def receive(self, peer: int, tag: int, what: str, flow: Flow, posted: Posted | None) -> Payload:
        request, header = posted or self.post_ahead(peer, tag)
        self.guard.wait(request, what, peer)
        if wire.is_inline(header):  # the tensors came with it, laid out as over the rings
            return wire.message(header.numpy())
        form, entries = wire.read_header(header)
        tensors = [
            None if e is None else torch.empty(e[1], dtype=e[0], device=self.device)
            for e in entries
        ]
        requests = [
            dist.irecv(t, src=peer, group=self.group, tag=tag) for t in tensors if t is not None
        ]
        if requests:  # one hand-off to the guard's waiters for all of them
            self.guard.wait(requests, what, peer)
        return wire.assemble(form, tensors)

    def _collect(self) -> None:
        """Forgets the sends that have completed (their buffers may go)."""
        self.sends = [s for s in self.sends if not all(r.is_completed() for r in s[0])]

    def finish(self) -> None:
        for requests, _buffers, what, peer in self.sends:
            self.guard.wait(requests, f"{what} to be received", peer)
        self.sends.clear()

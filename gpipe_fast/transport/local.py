"""The in-process Transport: a mailbox per step, boundary copies between CUDA stages."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import torch
from torch import Tensor

from gpipe_fast.device.streams import CellStreams
from gpipe_fast.nn.pytree import map_tensors
from gpipe_fast.transport.protocol import ACTIVATION, Flow, Payload


class LocalTransport:
    """In one process: a mailbox per step. A tensor crossing between CUDA stages is copied
    into the receiving stage on its copy stream (the native boundary copier, event-ordered);
    between CPU stages it is handed over as it is."""

    def __init__(self, streams: CellStreams, devices: Sequence[torch.device]) -> None:
        self.streams = streams
        self.devices = devices
        # (flow, receiving stage, micro-batch) -> (payload, read in place)
        self.mailbox: dict[tuple[Flow, int, int], tuple[Payload, bool]] = {}
        # Skip connections: (flow, receiving stage, micro-batch, key) -> value, from send_skip
        # until its recv_skip (the pop's forward, the stash's backward) takes it.
        self.skips: dict[tuple[Flow, int, int, Hashable], Tensor | None] = {}

    def send(self, flow: Flow, stage: int, microbatch: int, payload: Payload) -> None:
        receiver = stage + 1 if flow == ACTIVATION else stage - 1
        self.mailbox[(flow, receiver, microbatch)] = (payload, False)

    def deliver(self, flow: Flow, stage: int, microbatch: int, payload: Payload) -> None:
        self.mailbox[(flow, stage, microbatch)] = (payload, True)

    def recv(self, flow: Flow, stage: int, microbatch: int) -> Payload:
        payload, in_place = self.mailbox.pop((flow, stage, microbatch))
        device, receive = self.devices[stage], self.streams.receive
        if isinstance(payload, Tensor):
            return receive(payload.detach(), device, stage, from_caller=in_place)
        # Each tensor leaf received (a gradient tuple's None entries, and any other leaf of
        # an activation's pytree, stay as they are).
        return map_tensors(
            lambda t: receive(t.detach(), device, stage, from_caller=in_place), payload
        )

    def send_skip(
        self,
        flow: Flow,
        stage: int,
        receiver: int,
        microbatch: int,
        key: Hashable,
        tensor: Tensor | None,
    ) -> None:
        self.skips[(flow, receiver, microbatch, key)] = tensor

    def recv_skip(self, flow: Flow, stage: int, microbatch: int, key: Hashable) -> Tensor | None:
        tensor = self.skips.pop((flow, stage, microbatch, key))
        if tensor is None:
            return None
        # As a boundary tensor: handed over between CPU cells, copied on the receiving
        # cell's copy stream between CUDA cells.
        return self.streams.receive(tensor.detach(), self.devices[stage], stage)

    # In one process a value is in the mailbox as soon as it is sent: the communication
    # tasks and their bookkeeping have nothing to do.
    def post(self, flow: Flow, stage: int, microbatch: int) -> None:
        pass

    def fetch(self, flow: Flow, stage: int, microbatch: int) -> None:
        pass

    def post_skips(self, flow: Flow, stage: int, microbatch: int) -> None:
        pass

    def fetch_skips(self, flow: Flow, stage: int, microbatch: int) -> None:
        pass

    def expect(self, receives: Iterable[tuple[Flow, int, int]]) -> None:
        pass

    def finish(self) -> None:
        pass

    def discard(self) -> None:
        """Forgets the values sent and not received (a failed step's: nobody will)."""
        self.mailbox.clear()
        self.skips.clear()

    def pending(self) -> int:
        """Values sent and not received (0 after a complete step)."""
        return len(self.mailbox) + len(self.skips)

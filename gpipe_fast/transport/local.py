"""How boundary tensors reach the next stage: the Transport interface and its in-process form."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch
from torch import Tensor

from gpipe_fast.device.streams import CellStreams

# Activations flow from stage s to s + 1, their gradients from s to s - 1.
Flow = Literal["activation", "gradient"]
ACTIVATION: Flow = "activation"
GRADIENT: Flow = "gradient"

# What crosses: a lone tensor or a tuple (a gradient tuple has None where there is none).
Payload = Tensor | tuple[Tensor | None, ...]


class Transport(Protocol):
    """Moves what one stage produces to the stage that consumes it. Stages only call these,
    so the same stage code runs in one process (LocalTransport) or across processes."""

    def send(self, flow: Flow, stage: int, microbatch: int, payload: Payload) -> None:
        """`stage`'s result for its neighbour: activations for stage + 1, gradients for
        stage - 1 (None where a tensor has no gradient)."""

    def deliver(self, flow: Flow, stage: int, microbatch: int, payload: Payload) -> None:
        """Hands `stage` a value from outside the stages: the pipe's input (stage 0), the
        gradient of its output (last stage). Read in place where already on its device."""

    def recv(self, flow: Flow, stage: int, microbatch: int) -> Payload:
        """What `stage` receives for `microbatch`, in the structure it was sent, on its
        device and ready for its stream (detached: the stage decides what requires a
        gradient)."""


class LocalTransport:
    """In one process: a mailbox per step. A tensor crossing between CUDA stages is copied
    into the receiving stage on its copy stream (the native boundary copier, event-ordered);
    between CPU stages it is handed over as it is."""

    def __init__(self, streams: CellStreams, devices: Sequence[torch.device]) -> None:
        self.streams = streams
        self.devices = devices
        # (flow, receiving stage, micro-batch) -> (payload, read in place)
        self.mailbox: dict[tuple[Flow, int, int], tuple[Payload, bool]] = {}

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
        return tuple(
            None if t is None else receive(t.detach(), device, stage, from_caller=in_place)
            for t in payload
        )

    def pending(self) -> int:
        """Values sent and not received (0 after a complete step)."""
        return len(self.mailbox)

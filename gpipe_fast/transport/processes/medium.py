"""A medium: one way a message goes from one process of a pipeline group to another."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gpipe_fast.distributed.guard import Guard
from gpipe_fast.distributed.host_peers import HostPeers
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.distributed.shm_links import ShmLinks
from gpipe_fast.skip.layout import SkipLayout
from gpipe_fast.transport.choice import TransportChoice
from gpipe_fast.transport.protocol import Flow, Payload

# What a medium's receive posted ahead of its wait (its own kind of request), or None.
Posted = Any


class Medium(Protocol):
    """Carries the messages of some routes of a pipe's processes (a boundary's activations
    one way, its gradients back; a skip pair's the same), each message a payload with a tag,
    for one step (a step's transport makes its own). The transport across processes
    (across.py) sends each message over the first of its media that carries its route."""

    # Capability: a receive waits for its message itself, on the compute worker that needs
    # it (no receive posted ahead, no receiving worker): the schedule runs the receives of a
    # rank whose every incoming route is such a medium's inline.
    receives_inline: bool

    def carries(self, sender: int, receiver: int, flow: Flow) -> bool:
        """Whether messages of `flow` from group position `sender` to `receiver` go here."""

    def post_ahead(self, peer: int, tag: int) -> Posted | None:
        """Posts the receive of the message `peer` (a global rank) will send with `tag`, before
        the step waits for it (None: this medium has nothing to post)."""

    def send(self, payload: Payload, peer: int, tag: int, what: str, flow: Flow) -> None:
        """Puts `payload` on its way to global rank `peer` (`what` names it in errors); never
        waits for the receiver."""

    def receive(self, peer: int, tag: int, what: str, flow: Flow, posted: Posted | None) -> Payload:
        """The payload `peer` sent with `tag` (its receive `posted` ahead, or None), once here;
        every wait bounded by the pipe's guard."""

    def finish(self) -> None:
        """At the step's end: waits until everything sent has left this process."""


@dataclass
class Opened:
    """A medium opened for one pipe: makes each step's medium, and fails and closes with the
    pipe. `links`: its shared-memory rings, if it has some."""

    make: Callable[[], Medium]
    fail: Callable[[str], None]
    close: Callable[[], None]
    links: ShmLinks | None = None


# A medium's opener, called by every rank of the pipeline group at the pipe's build (with the
# layout, hosts, guard, cells' device and skips): the medium opened for the pipe, or None; and
# the pipe's TransportChoice if this medium is the one taken, else why it is not.
Opener = Callable[
    [ProcessLayout, HostPeers, Guard, torch.device, SkipLayout | None],
    tuple[Opened | None, TransportChoice],
]

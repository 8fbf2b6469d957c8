"""The same-host medium: each message whole in a shared-memory ring between two CPU processes."""

from __future__ import annotations

import torch

from gpipe_fast.distributed.guard import Guard
from gpipe_fast.distributed.host_peers import HostPeers
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.distributed.shm_links import ShmLinks, connect
from gpipe_fast.skip.layout import SkipLayout
from gpipe_fast.transport import wire
from gpipe_fast.transport.choice import TransportChoice
from gpipe_fast.transport.processes.medium import Opened, Posted
from gpipe_fast.transport.protocol import Flow, Payload


class RingMedium:
    """Carries the routes between ranks of one host (`links`, the pipe's rings): a message
    is the header and every tensor at once, in the ring of its flow. A receive waits for its
    message itself, in slices between which it looks for another rank's failure, and views
    the tensors in the received bytes; nothing is posted ahead, and a send never waits: what
    does not fit in the ring is queued, and `finish` waits until it is in."""

    receives_inline = True

    def __init__(self, links: ShmLinks, guard: Guard) -> None:
        self.links = links
        self.guard = guard

    def carries(self, sender: int, receiver: int, flow: Flow) -> bool:
        return self.links.carries(sender, receiver, flow)

    def post_ahead(self, peer: int, tag: int) -> Posted | None:
        return None  # a message waits in its ring until asked for

    def send(self, payload: Payload, peer: int, tag: int, what: str, flow: Flow) -> None:
        sender = self.links.sender(peer, flow)
        assert sender is not None, f"no ring to rank {peer}"
        # `message` holds the bytes its parts point at (a non-contiguous tensor's copy among
        # them) until send() has copied them into the ring or its queue.
        message = wire.gather(payload)
        try:
            sender.send(tag, message.parts)
        except ConnectionError as error:
            self.guard.check()
            channel = f"its channel to rank {peer} (sending {what})"
            raise self.guard.lost(channel, None, error, (peer,)) from error

    def receive(self, peer: int, tag: int, what: str, flow: Flow, posted: Posted | None) -> Payload:
        ring = self.links.receiver(peer, flow)
        assert ring is not None, f"no ring from rank {peer}"
        message = self.guard.poll(lambda seconds: ring.receive(tag, seconds), what, peer)
        # The header then each tensor at an aligned offset, as an inline message is laid out:
        # the tensors are views of the received bytes (they keep them alive).
        return wire.message(message)

    def finish(self) -> None:
        """Waits until what the rings' senders queued is in the rings."""
        for (peer, _), sender in self.links.senders.items():
            if sender.queued_bytes:
                what = f"rank {peer} to take in this step's messages"
                self.guard.poll(sender.flush, what, suspects=(peer,))


def open_rings(
    layout: ProcessLayout,
    hosts: HostPeers,
    guard: Guard,
    device: torch.device,
    skips: SkipLayout | None,
) -> tuple[Opened | None, TransportChoice]:
    """The rings between the ranks of the group that share a host (see shm_links.connect),
    or None and why not."""
    links, choice = connect(layout, hosts, guard, device, skips)
    if links is None:
        return None, choice
    return Opened(lambda: RingMedium(links, guard), links.fail, links.release, links), choice

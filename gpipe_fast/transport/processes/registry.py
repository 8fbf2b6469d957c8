"""The choice of a pipe's media between its processes, and each step's transport over them."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from gpipe_fast.device.streams import CellStreams
from gpipe_fast.distributed.guard import Guard
from gpipe_fast.distributed.host_peers import HostPeers
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.distributed.shm_links import ShmLinks, routes
from gpipe_fast.skip.layout import SkipLayout
from gpipe_fast.transport.choice import IN_PROCESS, TransportChoice
from gpipe_fast.transport.local import LocalTransport
from gpipe_fast.transport.processes.across import ProcessTransport
from gpipe_fast.transport.processes.group import GroupMedium
from gpipe_fast.transport.processes.medium import Medium, Opened, Opener
from gpipe_fast.transport.processes.rings import open_rings
from gpipe_fast.transport.protocol import ACTIVATION, GRADIENT, Transport

# The media tried before the process group's own send/recv (GroupMedium), which carries every
# route they do not, in order of preference; the first one that opens sets the pipe's
# TransportChoice (if none does, the first one's says why). A new medium: a module with its
# Medium class and its opener, and its opener here.
PREFERRED: list[Opener] = [open_rings]


@dataclass
class PipeMedia:
    """A pipe's media between its processes, chosen once: each step's transport goes over
    them. Their capabilities, for the schedule: the group's positions whose every receive is
    taken inline (`inline_receives`), and the rings that carry the step's agreed values."""

    choice: TransportChoice
    opened: list[Opened] = field(default_factory=list)
    inline_receives: list[int] = field(default_factory=list)

    @property
    def links(self) -> ShmLinks | None:
        """The pipe's shared-memory rings, if it has some."""
        return next((o.links for o in self.opened if o.links is not None), None)

    @property
    def control(self) -> ShmLinks | None:
        """The rings when they carry the step's agreed values (every rank on this host)."""
        links = self.links
        return links if links is not None and links.carries_control else None

    def step_media(self, layout: ProcessLayout, guard: Guard, device: torch.device) -> list[Medium]:
        """A step's media, in order of preference, the process group's last."""
        return [*(o.make() for o in self.opened), GroupMedium(layout, guard, device)]

    def fail(self, reason: str) -> None:
        for opened in self.opened:
            opened.fail(reason)

    def close(self) -> None:
        for opened in self.opened:
            opened.close()
        self.opened.clear()


def inline_receivers(
    ranks: int, every: set[tuple[int, int, int]], media: Sequence[Medium]
) -> list[int]:
    """The positions of the group whose every incoming route (of `every`: sending position,
    receiving position, lane) goes over a medium that receives inline: their compute workers
    receive their messages themselves. A rank that receives over another medium too keeps
    its receiving workers, which post those receives ahead of compute."""

    def inline(route: tuple[int, int, int]) -> bool:
        flow = ACTIVATION if route[2] == 0 else GRADIENT
        medium = next(m for m in media if m.carries(route[0], route[1], flow))
        return medium.receives_inline

    return [r for r in range(ranks) if all(inline(route) for route in every if route[1] == r)]


def open_media(
    layout: ProcessLayout,
    hosts: HostPeers | None,
    guard: Guard | None,
    device: torch.device,
    skips: SkipLayout | None,
) -> PipeMedia:
    """The pipe's media: none when every cell runs here, else the first of PREFERRED that
    opens (if any) and the process group's send/recv. Every rank of the group calls it, at
    the pipe's build (the openers agree across the ranks)."""
    if not layout.multi_process:
        return PipeMedia(IN_PROCESS)
    assert hosts is not None and guard is not None, "media across processes need the guard"
    opened: list[Opened] = []
    choice: TransportChoice | None = None
    for opener in PREFERRED:
        medium, why = opener(layout, hosts, guard, device, skips)
        choice = choice if medium is None and choice is not None else why
        if medium is not None:
            opened.append(medium)
            break
    assert choice is not None, "PREFERRED is empty"
    media = PipeMedia(choice, opened)
    every = routes(layout, skips)
    media.inline_receives = inline_receivers(
        layout.pp_size, every, media.step_media(layout, guard, device)
    )
    return media


def make_transport(
    streams: CellStreams,
    devices: Sequence[torch.device],
    layout: ProcessLayout,
    guard: Guard | None,
    media: PipeMedia,
    skips: dict[tuple[int, int], list[Hashable]] | None = None,
) -> Transport:
    """A step's transport: in-process when every stage runs here, else across the pipeline
    group's processes over the pipe's media (bounded by `guard`), carrying the skip pairs
    between ranks (`skips`, see across.skips_between_ranks) too."""
    local = LocalTransport(streams, devices)
    if not layout.multi_process:
        return local
    assert guard is not None, "a transport across processes needs the pipe's guard"
    device = devices[layout.local_cells[0]]
    return ProcessTransport(local, layout, media.step_media(layout, guard, device), skips)

"""The media a pipe's tensors take between its processes, and why (pipe.transport_kind)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class TransportChoice:
    """How a pipe's tensors travel between its processes, and why."""

    # The media's names (pipe.transport_kind): "in process", "shared memory", "shared memory
    # and gloo", or the backend's name.
    media: str
    reason: str


IN_PROCESS = TransportChoice("in process", "every cell of the pipe runs here")


class ChosenMedia(Protocol):
    """What a pipe reads of the media its side chose, once: which, and why; the positions of
    the pipeline group whose every receive is taken inline (for the schedule)."""

    @property
    def choice(self) -> TransportChoice: ...
    @property
    def inline_receives(self) -> list[int]: ...


@dataclass(frozen=True)
class InProcessMedia:
    """A pipe of one process: no media, nothing received inline."""

    choice: TransportChoice = IN_PROCESS
    inline_receives: list[int] = field(default_factory=list)

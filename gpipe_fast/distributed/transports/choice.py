"""The medium a pipe's tensors take between its processes, and why (pipe.transport_kind)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransportChoice:
    """How a pipe's tensors travel between its processes, and why."""

    # The media's names (pipe.transport_kind): "in process", "shared memory", "shared memory
    # and gloo", or the backend's name.
    media: str
    reason: str

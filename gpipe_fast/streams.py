"""Each cell's stream, boundary copies onto it, and the ordering with the caller's stream."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from gpipe_fast import _C


class CellStreams:
    """One compute stream per cell on CUDA (a CPU cell has none: the host runs in order).

    The executor orders cells by events recorded on these streams (device-side waits, no
    host synchronisation); this class makes each task run on its cell's stream, copies
    boundary tensors onto the receiving stream, and tells PyTorch's caching allocator which
    streams use a tensor so that no block is reused while a stream still reads it.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self.streams: list[Any] = [
            torch.cuda.Stream(device) if device.type == "cuda" else None for device in self.devices
        ]
        self.backend = "cuda" if any(s is not None for s in self.streams) else "host"

    def native(self) -> list[Any]:
        """The streams as plain facts for the executor (device -1: a host stream)."""
        return [
            _C.Stream(-1, 0)
            if stream is None
            else _C.Stream(stream.device.index, stream.cuda_stream)
            for stream in self.streams
        ]

    def on(self, cell: int) -> AbstractContextManager[Any]:
        """Makes `cell`'s stream (and device) current for the task's work."""
        stream = self.streams[cell]
        return nullcontext() if stream is None else torch.cuda.stream(stream)

    def receive(self, tensor: Tensor, device: torch.device, cell: int) -> Tensor:
        """`tensor` on `device`, read or copied on `cell`'s stream."""
        stream = self.streams[cell]
        if stream is None:
            return tensor.to(device)
        if tensor.is_cuda:
            tensor.record_stream(stream)  # the producer's block must outlive this stream's read
        with torch.cuda.stream(stream):
            return tensor.to(device, non_blocking=True)

    def join_caller(self, device: torch.device) -> None:
        """Makes the caller's current stream on `device` wait for every cell's work there."""
        if device.type != "cuda":
            return
        current = torch.cuda.current_stream(device)
        for stream in self.streams:
            if stream is not None and stream.device == device:
                current.wait_stream(stream)

    def cells_wait_caller(self) -> None:
        """Makes every cell's stream wait for the caller's work (the incoming gradients)."""
        for stream in self.streams:
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(stream.device))

"""Each cell's compute and copy streams, boundary copies, and the ordering with the caller."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from gpipe_fast import _C
from gpipe_fast.device.copy import boundary_copy, native_stream


class CellStreams:
    """A compute stream and an inbound copy stream per CUDA worker (a CPU worker has none:
    the host runs in order). Stage k uses the streams of its worker, stage_workers[k]
    (default: one worker per stage).

    The executor orders workers by events recorded on the compute streams (device-side
    waits, no host synchronisation); this class makes each task run on its stage's stream,
    copies boundary tensors into the receiving stage on its copy stream (native peer copies,
    peer access enabled between neighbouring stages), and tells PyTorch's caching allocator
    which streams use a tensor so that no block is reused while a stream still reads it.
    """

    def __init__(
        self, devices: Sequence[torch.device], stage_workers: Sequence[int] | None = None
    ) -> None:
        self.devices = list(devices)
        workers = list(stage_workers) if stage_workers is not None else list(range(len(devices)))
        self.worker_devices: dict[int, torch.device] = {}
        for stage, worker in enumerate(workers):
            first = self.worker_devices.setdefault(worker, self.devices[stage])
            if first != self.devices[stage]:
                raise ValueError(
                    f"devices: stages {workers.index(worker)} and {stage} share worker {worker} "
                    f"but sit on {first} and {self.devices[stage]}"
                )
        compute = {
            w: torch.cuda.Stream(d) if d.type == "cuda" else None
            for w, d in sorted(self.worker_devices.items())
        }
        copy = {
            w: torch.cuda.Stream(d) if d.type == "cuda" else None
            for w, d in sorted(self.worker_devices.items())
        }
        self.worker_streams: list[Any] = [compute[w] for w in sorted(compute)]
        self.streams: list[Any] = [compute[w] for w in workers]
        self.copy_streams: list[Any] = [copy[w] for w in workers]
        self.backend = "cuda" if any(s is not None for s in self.streams) else "host"
        self.copier = _C.BoundaryCopier() if self.backend == "cuda" else None
        # Activations go from stage k-1 to k and their gradients back: both directions.
        for before, after in zip(self.devices, self.devices[1:], strict=False):
            if self.copier is not None and before.type == after.type == "cuda":
                self.copier.enable_peer_access(before.index, after.index)
                self.copier.enable_peer_access(after.index, before.index)

    def communication_stream(self) -> Any:
        """The communication worker's stream: a stream of its own on the first worker's CUDA
        device (communication kernels overlap with compute there), a host stream on CPU."""
        device = self.worker_devices[min(self.worker_devices)]
        if device.type != "cuda":
            return _C.Stream(-1, 0)
        self.comm_stream = torch.cuda.Stream(device)
        return native_stream(self.comm_stream)

    def native(self) -> list[Any]:
        """Each worker's stream as plain facts for the executor (device -1: a host stream)."""
        return [_C.Stream(-1, 0) if s is None else native_stream(s) for s in self.worker_streams]

    def on(self, cell: int) -> AbstractContextManager[Any]:
        """Makes `cell`'s stream (and device) current for the task's work."""
        stream = self.streams[cell]
        return nullcontext() if stream is None else torch.cuda.stream(stream)

    def receive(
        self, tensor: Tensor, device: torch.device, cell: int, *, from_caller: bool = False
    ) -> Tensor:
        """`tensor` on `device`, ready for `cell`'s stream: a boundary tensor from another
        cell is always copied between CUDA cells (also on one GPU, so that no cell can
        change another's tensors in place); a tensor from the caller (the pipe's input, the
        loss gradient) is read in place when it is already on `device`."""
        stream = self.streams[cell]
        if stream is None:
            # A CPU cell: a CPU tensor is handed over as it is (the common case, on every
            # task: .to() would cost microseconds to say so).
            return tensor if tensor.is_cpu and device.type == "cpu" else tensor.to(device)
        if not tensor.is_cuda or (from_caller and tensor.device == device):
            if tensor.is_cuda:
                tensor.record_stream(stream)  # the caller's block must outlive this stream's read
            with torch.cuda.stream(stream):
                return tensor.to(device, non_blocking=True)
        assert self.copier is not None  # a CUDA cell exists
        return boundary_copy(self.copier, tensor, device, stream, self.copy_streams[cell])

    def join_caller(self, device: torch.device) -> None:
        """Makes the caller's current stream on `device` wait for every cell's work there."""
        if device.type != "cuda":
            return
        current = torch.cuda.current_stream(device)
        for stream in self.worker_streams:
            if stream is not None and stream.device == device:
                current.wait_stream(stream)

    def cells_wait_caller(self) -> None:
        """Makes every cell's stream wait for the caller's work on its device (the incoming
        gradients of the backward)."""
        for stream in self.worker_streams:
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(stream.device))

    def cell_waits_caller(self, cell: int, tensors: Sequence[Tensor]) -> None:
        """Makes `cell`'s stream wait for the caller's work so far on every device that holds
        one of `tensors` (the pipe's input, before cell 0 reads it)."""
        stream = self.streams[cell]
        if stream is None:
            return
        for device in {t.device for t in tensors if t.is_cuda}:
            stream.wait_stream(torch.cuda.current_stream(device))

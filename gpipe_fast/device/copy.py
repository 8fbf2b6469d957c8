"""Boundary copies between CUDA cells: the native copier on the receiving cell's copy stream."""

from __future__ import annotations

import torch
from torch import Tensor

from gpipe_fast import _C


def native_stream(stream: torch.cuda.Stream) -> _C.Stream:
    """A torch CUDA stream as the plain fact the native core takes."""
    return _C.Stream(stream.device.index, stream.cuda_stream)


def boundary_copy(
    copier: _C.BoundaryCopier,
    tensor: Tensor,
    device: torch.device,
    consumer: torch.cuda.Stream,
    copy_stream: torch.cuda.Stream,
) -> Tensor:
    """A copy of CUDA `tensor` on CUDA `device`, made on `copy_stream` and ready for work on
    `consumer` (the receiving cell's stream, already ordered after the tensor's producer).

    The destination is allocated on the consumer's stream, so PyTorch's caching allocator
    reuses its block only after the consumer's later work; the copier makes the copy stream
    wait for the consumer's work so far before writing it. The source is marked as used by
    the copy stream, so its block is not handed out again while the copy may still read it.
    """
    with torch.cuda.stream(consumer):
        if tensor.is_contiguous():
            source = tensor
        else:
            tensor.record_stream(consumer)  # read here, by the consumer's packing kernel
            source = tensor.contiguous()
        destination = torch.empty(source.shape, dtype=source.dtype, device=device)
    source.record_stream(copy_stream)
    copier.copy(
        destination.data_ptr(),
        destination.device.index,
        source.data_ptr(),
        source.device.index,
        source.numel() * source.element_size(),
        native_stream(consumer),
        native_stream(copy_stream),
    )
    return destination

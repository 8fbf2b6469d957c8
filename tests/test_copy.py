"""Boundary copies: the native copier's errors without a GPU; on a GPU, exact copies (cupy as
the oracle), and a source block that outlives a copy still in flight."""

from __future__ import annotations

import pytest
import torch

from gpipe_fast import _C
from gpipe_fast.device.copy import boundary_copy, native_stream

from helpers import device_sleep_cycles

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(not _C.cuda_compiled(), reason="built without CUDA")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU failure path")
def test_without_a_gpu_cuda_errors_name_the_call_and_the_source_line() -> None:
    copier = _C.BoundaryCopier()
    assert copier.enable_peer_access(0, 0)  # a device with itself needs no driver call
    named = r"cudaDeviceCanAccessPeer.*failed: cudaError\w+.*p2p_copy"
    with pytest.raises(RuntimeError, match=named):
        copier.enable_peer_access(0, 1)
    with pytest.raises(RuntimeError, match=r"failed: cudaError\w+ .* at .*:\d+"):
        copier.copy(0, 0, 0, 0, 64, _C.Stream(0, 0), _C.Stream(0, 0))
    assert copier.live_events == 0  # the failed copy gave its events back


@pytest.mark.skipif(not _C.cuda_compiled(), reason="built without CUDA")
def test_copy_arguments_are_checked_before_any_cuda_call() -> None:
    copier = _C.BoundaryCopier()
    with pytest.raises(ValueError, match="between device buffers"):
        copier.copy(0, 0, 0, -1, 64, _C.Stream(0, 0), _C.Stream(0, 0))
    with pytest.raises(ValueError, match="copy stream must be on the source or destination"):
        copier.copy(0, 0, 0, 0, 64, _C.Stream(0, 0), _C.Stream(3, 0))
    with pytest.raises(ValueError, match="two device indices"):
        copier.enable_peer_access(-1, 0)


# -- on a GPU --------------------------------------------------------------------------------


def _streams() -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    consumer, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    consumer.wait_stream(torch.cuda.current_stream())
    return consumer, copy_stream


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "offset"])
def test_copy_matches_cupys(dtype: torch.dtype, layout: str) -> None:
    cupy = pytest.importorskip("cupy")
    base = torch.randint(0, 100, (257, 129), device="cuda").to(dtype)
    tensor = {"contiguous": base, "transposed": base.t(), "offset": base[3:]}[layout]
    consumer, copy_stream = _streams()
    copier = _C.BoundaryCopier()
    copied = boundary_copy(copier, tensor, tensor.device, consumer, copy_stream)
    consumer.synchronize()
    assert copied.shape == tensor.shape and copied.dtype == dtype
    assert copied.is_contiguous() and copied.data_ptr() != tensor.data_ptr()
    # cupy copies the same bytes through its own runtime: the reference.
    reference = cupy.ascontiguousarray(cupy.asarray(tensor.contiguous().view(torch.uint8)))
    assert torch.equal(copied.view(torch.uint8), torch.as_tensor(reference, device="cuda"))
    assert torch.equal(copied, tensor)
    assert copier.live_events == 0


@cuda
@pytest.mark.parametrize("record", [True, False], ids=["record_stream", "control-without"])
def test_source_block_is_not_reused_while_the_copy_reads_it(record: bool) -> None:
    """The copy is held back behind a 100 ms device-side sleep while the caller drops the
    source and allocates a same-size tensor, which the caching allocator would place in the
    source's block. With record_stream the copy still sees the original values; the control
    (the same copy without it) shows that the race is really exposed every time."""
    copier = _C.BoundaryCopier()
    consumer, copy_stream = _streams()
    source = torch.randn(1 << 22, device="cuda")
    want = source.clone()
    address = source.data_ptr()
    torch.cuda.synchronize()
    with torch.cuda.stream(consumer):
        torch.cuda._sleep(device_sleep_cycles(100)[0])  # the copy waits for the consumer
    if record:
        copied = boundary_copy(copier, source, source.device, consumer, copy_stream)
    else:
        with torch.cuda.stream(consumer):
            copied = torch.empty_like(source)
        copier.copy(
            copied.data_ptr(), 0, source.data_ptr(), 0, source.numel() * 4,
            native_stream(consumer), native_stream(copy_stream),
        )  # fmt: skip
    del source
    reused = torch.zeros(1 << 22, device="cuda")  # on the caller's stream, at once
    torch.cuda.synchronize()
    if record:
        assert torch.equal(copied, want)
    else:
        assert reused.data_ptr() == address  # the allocator did hand the block out again
        assert not torch.equal(copied, want)  # and the copy read the zeros: a race, shown


@cuda
def test_consumer_waits_for_the_copy() -> None:
    """The copy stream is held back; work the consumer enqueues after the copy reads the copied
    values, not the uninitialised destination."""
    copier = _C.BoundaryCopier()
    consumer, copy_stream = _streams()
    source = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    with torch.cuda.stream(copy_stream):
        torch.cuda._sleep(device_sleep_cycles(100)[0])
    copied = boundary_copy(copier, source, source.device, consumer, copy_stream)
    with torch.cuda.stream(consumer):
        total = copied.sum()
    torch.cuda.synchronize()
    assert total.item() == source.sum().item()


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_peer_copy_between_two_gpus() -> None:
    copier = _C.BoundaryCopier()
    copier.enable_peer_access(0, 1)
    assert copier.enable_peer_access(0, 1) == copier.enable_peer_access(0, 1)  # idempotent
    source = torch.randn(1000, 3, device="cuda:0")
    consumer = torch.cuda.Stream("cuda:1")
    copy_stream = torch.cuda.Stream("cuda:1")
    consumer.wait_stream(torch.cuda.current_stream("cuda:0"))
    copied = boundary_copy(copier, source, torch.device("cuda:1"), consumer, copy_stream)
    consumer.synchronize()
    assert copied.device == torch.device("cuda:1")
    assert torch.equal(copied.cpu(), source.cpu())

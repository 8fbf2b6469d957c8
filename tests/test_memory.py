"""Memory: resources and the recompute pool through the bindings, and pipe.memory_stats()."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch

import gpipe_fast as gf
from gpipe_fast import _C

from helpers import mlp

KiB = 1024
MiB = 1024 * KiB
STREAM_A = _C.Stream(0, 0xA)
STREAM_B = _C.Stream(0, 0xB)
# One micro-batch's recompute: activations of a few sizes (four distinct size classes).
MICROBATCH = [100 * KiB, 300 * KiB, 3000, 200 * KiB]

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
cuda_build = pytest.mark.skipif(not _C.cuda_compiled(), reason="built without CUDA")


def _pool(
    capacity: int = 64 * MiB, arena: int = MiB
) -> tuple[_C.RecomputePool, _C.SimulatedMemoryResource]:
    upstream = _C.SimulatedMemoryResource(capacity)
    return _C.RecomputePool(upstream, arena), upstream


def _run_microbatch(pool: _C.RecomputePool, stream: _C.Stream) -> list[int]:
    """Allocates a micro-batch's activations on `stream`, then frees them (its backward)."""
    blocks = [pool.allocate(size, stream) for size in MICROBATCH]
    for block, size in zip(blocks, MICROBATCH, strict=True):
        pool.deallocate(block, size, stream)
    return blocks


# -- resources ------------------------------------------------------------------------------


def test_simulated_resource_aligns_counts_and_runs_out() -> None:
    resource = _C.SimulatedMemoryResource(4 * KiB)
    blocks = [resource.allocate(size) for size in (1, 300, 1000)]
    assert all(b % _C.ALLOCATION_ALIGNMENT == 0 for b in blocks)
    assert len(set(blocks)) == 3
    assert resource.allocated_bytes == 256 + 512 + 1024
    assert resource.live_blocks == 3
    with pytest.raises(MemoryError, match="out of memory"):
        resource.allocate(4 * KiB)
    assert resource.allocate(0) == 0
    for block, size in zip(blocks, (1, 300, 1000), strict=True):
        resource.deallocate(block, size)
    assert resource.allocated_bytes == 0
    assert resource.allocate(4 * KiB) == blocks[0]  # freed ranges merged back into one


def test_simulated_resource_rejects_double_free_and_wrong_size() -> None:
    resource = _C.SimulatedMemoryResource(MiB)
    block = resource.allocate(1000)
    with pytest.raises(ValueError, match="allocated with 1000"):
        resource.deallocate(block, 999)
    resource.deallocate(block, 1000)
    with pytest.raises(ValueError, match="double free"):
        resource.deallocate(block, 1000)


def test_host_resource_gives_writable_aligned_memory() -> None:
    resource = _C.HostMemoryResource()
    block = resource.allocate(4096)
    assert block % _C.ALLOCATION_ALIGNMENT == 0
    ctypes.memset(block, 0x5A, 4096)
    assert ctypes.string_at(block + 4095, 1) == b"\x5a"
    resource.deallocate(block, 4096)


# -- recompute pool -------------------------------------------------------------------------


def test_pool_size_classes() -> None:
    assert [_C.RecomputePool.size_class(b) for b in (1, 257, 1000, 1025, 3000)] == [
        256,
        512,
        1024,
        1280,
        3072,
    ]
    assert _C.RecomputePool.size_class(MiB + 1) == MiB + 256 * KiB


def test_pool_keeps_one_microbatch_reserved_across_microbatches() -> None:
    pool, upstream = _pool()
    first = _run_microbatch(pool, STREAM_A)
    assert pool.stats().reserved_bytes == MiB
    for _ in range(7):
        assert _run_microbatch(pool, STREAM_A) == first
    stats = pool.stats()
    assert stats.as_dict() == {
        "current_bytes": 0,
        "peak_bytes": sum(MICROBATCH),
        "reserved_bytes": MiB,
        "arenas": 1,
        "allocations": 8 * len(MICROBATCH),
        "reuses": 7 * len(MICROBATCH),
    }
    assert upstream.allocated_bytes == MiB
    pool.reset_peak()
    assert pool.stats().peak_bytes == 0


def test_pool_reuses_across_streams_only_after_release() -> None:
    pool, _ = _pool()
    a = pool.allocate(4000, STREAM_A)
    pool.deallocate(a, 4000, STREAM_A)
    b = pool.allocate(4000, STREAM_B)
    assert b != a  # A's block may still be in use by A's queued work
    assert pool.stats().reuses == 0
    pool.deallocate(b, 4000, STREAM_B)
    pool.release_stream(STREAM_A)
    assert pool.allocate(4000, STREAM_B) == b  # B's own block first
    assert pool.allocate(4000, STREAM_B) == a  # then A's, released
    assert pool.stats().reuses == 2


def test_pool_trim_and_errors() -> None:
    pool, upstream = _pool()
    block = pool.allocate(2 * MiB, STREAM_A)
    with pytest.raises(ValueError, match="allocated with"):
        pool.deallocate(block, 1, STREAM_A)
    pool.deallocate(block, 2 * MiB, STREAM_A)
    with pytest.raises(ValueError, match="double free"):
        pool.deallocate(block, 2 * MiB, STREAM_A)
    assert pool.trim() == 0  # not released: stream A may still use it
    pool.release_stream(STREAM_A)
    assert pool.trim() == 2 * MiB
    assert pool.stats().reserved_bytes == 0
    assert upstream.allocated_bytes == 0


def test_pool_out_of_memory_is_memory_error_and_pool_stays_usable() -> None:
    pool, _ = _pool(capacity=MiB)
    block = pool.allocate(MiB, STREAM_A)
    with pytest.raises(MemoryError, match="RecomputePool"):
        pool.allocate(1, STREAM_A)
    pool.deallocate(block, MiB, STREAM_A)
    assert pool.allocate(MiB, STREAM_A) == block


def test_pool_rejects_bad_arena_size() -> None:
    with pytest.raises(ValueError, match="arena_bytes"):
        _C.RecomputePool(_C.SimulatedMemoryResource(MiB), 1000)


def test_pool_from_four_threads() -> None:
    pool, _ = _pool(capacity=256 * MiB)
    errors: list[BaseException] = []

    def cell(k: int) -> None:
        stream = _C.Stream(0, 0x100 + k)
        try:
            for _ in range(200):
                _run_microbatch(pool, stream)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=cell, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = pool.stats()
    assert stats.allocations == 4 * 200 * len(MICROBATCH)
    assert stats.reuses == stats.allocations - 4 * len(MICROBATCH)
    assert stats.current_bytes == 0
    assert stats.arenas == 4


# -- torch allocator entry points -----------------------------------------------------------


def test_torch_allocator_symbols_match_the_build() -> None:
    symbols = _C.torch_allocator_symbols()
    if not _C.cuda_compiled():
        assert symbols is None
        assert _C.torch_allocator_pool() is None
        return
    assert symbols == ("gpipe_fast_malloc", "gpipe_fast_free")
    library = ctypes.CDLL(_C.__file__)
    for name in symbols:
        assert getattr(library, name)  # exported by the module, as CUDAPluggableAllocator needs
    assert isinstance(_C.torch_allocator_pool(), _C.RecomputePool)


@cuda_build
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU failure path")
def test_torch_allocator_without_a_gpu_returns_null_and_never_throws() -> None:
    library = ctypes.CDLL(_C.__file__)
    malloc, free = library.gpipe_fast_malloc, library.gpipe_fast_free
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    assert malloc(1024, 0, None) is None  # the CUDA error is reported on stderr, not thrown
    assert malloc(0, 0, None) is None
    free(None, 0, 0, None)
    free(0x1000, 1024, 0, None)  # not a pool block: reported on stderr, not thrown
    pool = _C.torch_allocator_pool()
    assert pool is not None and pool.stats().allocations == 0


def test_pool_registry_routes_frees_to_the_owner_and_retires() -> None:
    upstream = _C.SimulatedMemoryResource(64 * MiB)
    registry = _C.PoolRegistry(upstream, MiB)
    first, second = registry.create(), registry.create()
    block = registry.allocate(second, 300 * KiB, STREAM_A)
    assert registry.pool(second).stats().current_bytes == 300 * KiB
    assert registry.pool(first).stats().current_bytes == 0
    registry.deallocate(block, 300 * KiB, STREAM_A)
    assert registry.pool(second).stats().current_bytes == 0
    with pytest.raises(ValueError, match="no recompute pool handed out"):
        registry.deallocate(block, 300 * KiB, STREAM_A)
    assert registry.retire(second) == MiB  # its one arena goes back upstream
    assert upstream.allocated_bytes == 0
    with pytest.raises(ValueError, match="no recompute pool with id 5"):
        registry.pool(5)


@cuda_build
def test_selecting_an_unknown_torch_allocator_pool_is_refused() -> None:
    assert _C.select_torch_allocator_pool(0) == 0  # the default pool always exists
    with pytest.raises(ValueError, match="no recompute pool with id"):
        _C.select_torch_allocator_pool(_C.torch_allocator_pools().pools)


# -- pipe.memory_stats() --------------------------------------------------------------------


def test_memory_stats_counts_stashed_inputs_until_backward(make_pipe: type[gf.GPipe]) -> None:
    width, batch, chunks = 6, 8, 4
    model = mlp(2, width)  # Linear, Tanh, Linear, Tanh in float64
    pipe = make_pipe(
        model, balance=[2, 2], devices=["cpu", "cpu"], chunks=chunks, checkpoint="always"
    )
    assert [s["stash_bytes"] for s in pipe.memory_stats()] == [0, 0]
    x = torch.randn(batch, width, dtype=torch.float64)
    out = pipe(x)
    stats = pipe.memory_stats()
    # Cell 0 stashes views of x (one storage); cell 1 stashes cell 0's four outputs.
    assert stats[0]["stash_bytes"] == x.nbytes == batch * width * 8
    assert stats[1]["stash_bytes"] == chunks * (batch // chunks) * width * 8
    for cell in stats:
        assert cell["recompute_peak_bytes"] is None
        assert cell["torch_peak_allocated_bytes"] is None  # CPU cells
    out.sum().backward()
    assert [s["stash_bytes"] for s in pipe.memory_stats()] == [0, 0]


def test_memory_stats_adds_up_live_steps_and_forgets_dropped_ones(
    make_pipe: type[gf.GPipe],
) -> None:
    pipe = make_pipe(mlp(2, 6), balance=[2, 2], devices=["cpu", "cpu"], chunks=2)
    x1, x2 = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    out1 = pipe(x1)
    one = pipe.memory_stats()[1]["stash_bytes"]
    out2 = pipe(x2)
    assert pipe.memory_stats()[1]["stash_bytes"] == 2 * one
    del out2  # the step dies with its output
    assert pipe.memory_stats()[1]["stash_bytes"] == one
    with torch.no_grad():
        pipe(x2)  # nothing is stashed without autograd
    assert pipe.memory_stats()[1]["stash_bytes"] == one
    out1.sum().backward()
    assert pipe.memory_stats()[1]["stash_bytes"] == 0


# -- GPU (unverified until run on a GPU) ----------------------------------------------------


@cuda
@pytest.mark.parametrize("stream_ordered", [True, False])
def test_cuda_resource_allocates_usable_device_memory(stream_ordered: bool) -> None:
    resource = _C.CudaMemoryResource(stream_ordered)
    torch_stream = torch.cuda.current_stream()
    stream = _C.Stream(torch_stream.device.index, torch_stream.cuda_stream)
    size = 1 << 20
    address = resource.allocate(size, stream)
    assert address % _C.ALLOCATION_ALIGNMENT == 0

    interface = {"shape": (size // 4,), "typestr": "<f4", "data": (address, False), "version": 3}
    buffer = types.SimpleNamespace(__cuda_array_interface__=interface)  # torch imports it

    view = torch.as_tensor(buffer, device=torch_stream.device)
    view.fill_(3.0)
    assert float(view.sum()) == 3.0 * (size // 4)
    del view
    resource.deallocate(address, size, stream)
    with pytest.raises(MemoryError):
        resource.allocate(1 << 60, stream)


@cuda
def test_cuda_pool_reuses_blocks_on_a_stream() -> None:
    device = torch.cuda.current_device()
    pool = _C.RecomputePool(_C.CudaMemoryResource(), 4 * MiB)
    stream = _C.Stream(device, torch.cuda.current_stream().cuda_stream)
    first = _run_microbatch(pool, stream)
    assert _run_microbatch(pool, stream) == first
    pool.release_stream(stream)
    torch.cuda.synchronize()
    assert pool.trim() == 4 * MiB


# Runs in a child process: the pluggable allocator's MemPool state is process-wide.
_PLUGGABLE_SCRIPT = textwrap.dedent(
    """
    import torch
    from gpipe_fast import _C

    malloc, free = _C.torch_allocator_symbols()
    allocator = torch.cuda.memory.CUDAPluggableAllocator(_C.__file__, malloc, free)
    pool = torch.cuda.MemPool(allocator.allocator())
    with torch.cuda.use_mem_pool(pool):
        x = torch.arange(1 << 20, device="cuda", dtype=torch.int64)
        y = (x * 2).sum()
    assert int(y) == (1 << 20) * ((1 << 20) - 1), int(y)
    assert _C.torch_allocator_pool().stats().allocations > 0
    with torch.cuda.use_mem_pool(pool):
        try:
            torch.empty(1 << 60, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            pass
        else:
            raise AssertionError("no OutOfMemoryError")
    z = torch.ones(4, device="cuda") + 1  # the pipe (here: torch) stays usable
    assert float(z.sum()) == 8.0
    print("ok")
    """
)


@cuda
def test_pluggable_allocator_through_a_mem_pool() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PLUGGABLE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr

"""Re-materialised activations in gpipe_fast's native pools: one torch MemPool per CUDA cell."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from gpipe_fast import _C


@functools.cache
def _allocator() -> Any:
    """The process's pluggable allocator over gpipe_fast._C's extern "C" entry points."""
    symbols = _C.torch_allocator_symbols()
    if symbols is None:
        raise RuntimeError(
            "recompute_pool=True needs gpipe_fast built with its CUDA backend, which this build "
            "lacks (nvcc was not found, or torch was a CPU build, when it was built): reinstall "
            "it with nvcc on PATH and a CUDA torch, or with GPIPE_FAST_CUDA=ON"
        )
    malloc, free = symbols
    return torch.cuda.memory.CUDAPluggableAllocator(_C.__file__, malloc, free)


class RecomputeMemory:
    """Routes what a CUDA cell allocates while it recomputes (the activations its backward
    then uses, and the recompute's temporaries) to a torch MemPool of its own, whose segments
    come from that cell's native RecomputePool. PyTorch's caching allocator still splits and
    reuses blocks inside the MemPool; the native pool accounts for them per cell (peak bytes)
    and keeps them apart from the long-lived stash and parameters. CPU cells are left alone.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        cuda = [device.type == "cuda" for device in self.devices]
        self.registry: Any = _C.torch_allocator_pools() if any(cuda) else None
        if any(cuda) and self.registry is None:
            _allocator()  # raises the build error
        self.ids: list[int | None] = [self.registry.create() if c else None for c in cuda]
        self.pools: list[Any] = [
            torch.cuda.MemPool(_allocator().allocator()) if c else None for c in cuda
        ]

    @contextmanager
    def use(self, cell: int) -> Iterator[None]:
        """Makes the calling thread's allocations go to `cell`'s pool (a no-op on CPU)."""
        pool, pool_id = self.pools[cell], self.ids[cell]
        if pool is None or pool_id is None:
            yield
            return
        previous = _C.select_torch_allocator_pool(pool_id)
        try:
            with torch.cuda.use_mem_pool(pool, self.devices[cell]):
                yield
        finally:
            _C.select_torch_allocator_pool(previous)

    def peak_bytes(self, cell: int) -> int | None:
        """Highest bytes `cell`'s recompute has held from its native pool (None on CPU)."""
        pool_id = self.ids[cell]
        return None if pool_id is None else self.registry.pool(pool_id).stats().peak_bytes

    def close(self) -> None:
        """Gives the pools' memory back: torch's segments first, then the native arenas. Only
        between steps (it synchronises the cells' devices)."""
        if self.registry is None:
            return
        for device in {d for d in self.devices if d.type == "cuda"}:
            torch.cuda.synchronize(device)
        self.pools = [None] * len(self.pools)  # torch frees a dropped MemPool's segments
        torch.cuda.empty_cache()
        for pool_id in self.ids:
            if pool_id is not None:
                self.registry.retire(pool_id)
        self.ids = [None] * len(self.ids)
        self.registry = None

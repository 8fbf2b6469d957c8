"""Boundary copy bandwidth on a GPU: gpipe_fast's copier vs cupy vs torch (pytest-benchmark)."""

# The CUDA event record/wait overhead per task is bench_executor.py's
# test_executor_cuda_events_noop_tasks; it is not repeated here.

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe_fast import _C

# bench/ on the path whatever pytest's import mode: the copy script imports its siblings.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_copy_bandwidth as gpu
from reporting import MIB

COPIES_PER_ROUND = 8  # one timed call enqueues these back to back, then waits for them
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and _C.cuda_compiled()),
    reason="needs a CUDA GPU and gpipe_fast built with CUDA",
)


def _devices(route: str) -> tuple[torch.device, torch.device]:
    if route == "peer":
        if torch.cuda.device_count() < 2:
            pytest.skip("needs 2 GPUs")
        return torch.device("cuda", 0), torch.device("cuda", 1)
    return torch.device("cuda", 0), torch.device("cuda", 0)


@needs_cuda
@pytest.mark.parametrize("mib", [64, 256])
@pytest.mark.parametrize("route", ["same-device", "peer"])
@pytest.mark.parametrize("copier", gpu.COPIERS)
def test_copy_bandwidth(benchmark: Any, copier: str, route: str, mib: int) -> None:
    """`COPIES_PER_ROUND` copies of `mib` MiB enqueued on one stream of the destination GPU,
    then a wait for that stream; extra_info["gbps"] = bytes moved / median time."""
    if copier == "cupy" and not gpu.cupy_available():
        pytest.skip("cupy is not importable")
    if copier == "gpipe_fast" and not hasattr(_C, "BoundaryCopier"):
        pytest.skip("gpipe_fast._C has no BoundaryCopier in this build")
    src_device, dst_device = _devices(route)
    nbytes = mib * MIB
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=src_device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=dst_device)
    native = _C.BoundaryCopier() if copier == "gpipe_fast" else None
    if route == "peer":
        dst.copy_(src)  # torch enables peer access for the pair on its first copy
        dst.zero_()
        if native is not None:
            gpu.enable_peer_access(native, dst_device.index, src_device.index)
    torch.cuda.synchronize(src_device)
    torch.cuda.synchronize(dst_device)
    stream = torch.cuda.Stream(dst_device)
    launch = gpu.make_copy_launcher(copier, dst, src, stream, native)

    launch()
    stream.synchronize()
    assert torch.equal(dst, src.to(dst_device)), f"{copier} copied {mib} MiB wrongly"

    def copies() -> None:
        for _ in range(COPIES_PER_ROUND):
            launch()
        stream.synchronize()

    benchmark.pedantic(copies, rounds=20, warmup_rounds=2, iterations=1)
    benchmark.extra_info["bytes_per_round"] = COPIES_PER_ROUND * nbytes
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["gbps"] = gpu.gigabytes_per_second(
            nbytes, COPIES_PER_ROUND, benchmark.stats.stats.median
        )

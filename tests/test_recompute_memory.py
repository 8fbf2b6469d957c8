"""recompute_pool=True: argument checks and CPU cells on any machine; on a GPU, exact
gradients with the recompute in per-cell native pools, their statistics, an out-of-memory in
the pool, and the memory given back on close."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.api.gpipe import pipeline_of

from helpers import assert_same_run, mlp, pipe_run, reference_run

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_recompute_pool_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="recompute_pool must be a bool"):
        gf.GPipe(mlp(2), [1, 1], devices=["cpu", "cpu"], recompute_pool="yes")  # type: ignore[arg-type]


def test_cpu_cells_are_left_alone(make_pipe) -> None:
    module = mlp(2)
    x = torch.randn(9, 6, dtype=torch.float64)
    want = reference_run(module, x)
    pipe = make_pipe(
        module, [2, 2], devices=["cpu", "cpu"], chunks=3, checkpoint="always", recompute_pool=True
    )
    assert_same_run(pipe_run(pipe, module, x), want)
    assert [s["recompute_peak_bytes"] for s in pipe.memory_stats()] == [None, None]


# -- on a GPU --------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_gradients_match_with_the_recompute_in_native_pools(make_pipe, checkpoint: str) -> None:
    module = mlp(2).cuda()
    x = torch.randn(12, 6, dtype=torch.float64, device="cuda")
    want = reference_run(module, x)
    pipe = make_pipe(
        module, [2, 2], devices=["cuda:0"] * 2, chunks=4, checkpoint=checkpoint,
        recompute_pool=True,
    )  # fmt: skip
    assert_same_run(pipe_run(pipe, module, x), want)
    peaks = [s["recompute_peak_bytes"] for s in pipe.memory_stats()]
    if checkpoint == "never":
        assert peaks == [0, 0]  # nothing was recomputed
    else:
        assert all(peak is not None and peak > 0 for peak in peaks)


@cuda
def test_each_cell_has_its_own_pool_and_close_gives_the_memory_back(make_pipe) -> None:
    module = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).cuda()
    pipe = make_pipe(
        module, [2, 2], devices=["cuda:0"] * 2, chunks=4, checkpoint="always", recompute_pool=True
    )
    pipe(torch.randn(64, 256, device="cuda")).sum().backward()
    memory = pipeline_of(pipe).recompute_memory
    ids = list(memory.ids)
    registry = _C.torch_allocator_pools()
    assert len(set(ids)) == 2 and 0 not in ids  # not the default pool
    assert all(registry.pool(i).stats().allocations > 0 for i in ids)
    pipe.close()
    torch.cuda.synchronize()
    assert all(registry.pool(i).stats().reserved_bytes == 0 for i in ids)


class _HugeWhenRecomputing(nn.Module):
    """Doubles its input; while armed, its recompute asks for more memory than any GPU has."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and gf.is_recomputing():
            torch.empty(1 << 50, dtype=torch.uint8, device=x.device)
        return x * 2


@cuda
def test_out_of_memory_in_the_pool_is_torchs_and_the_pipe_stays_usable(make_pipe) -> None:
    huge = _HugeWhenRecomputing()
    module = nn.Sequential(nn.Linear(8, 8), huge).cuda()
    pipe = make_pipe(
        module, [1, 1], devices=["cuda:0"] * 2, chunks=2, checkpoint="always", recompute_pool=True
    )
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(torch.cuda.OutOfMemoryError, match="cell 1"):
        pipe(x).sum().backward()
    huge.armed = False
    module.zero_grad()
    pipe(x).sum().backward()
    torch.testing.assert_close(module[0].weight.grad, 2 * x.sum(0).expand(8, 8))

"""Scatter and gather of micro-batches: near-equal sizes, nothing dropped, tuples kept."""

from __future__ import annotations

import pytest
import torch

from gpipe_fast.microbatch import gather, scatter, split_sizes


@pytest.mark.parametrize(
    ("n", "chunks", "sizes"),
    [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (3, 8, [1, 1, 1]), (1, 1, [1]), (7, 1, [7])],
)
def test_split_sizes(n: int, chunks: int, sizes: list[int]) -> None:
    assert split_sizes(n, chunks) == sizes


def test_scatter_gather_round_trip_tensor_and_tuple() -> None:
    x = torch.randn(10, 3)
    parts = scatter(x, 4)
    assert [p.shape[0] for p in parts] == [3, 3, 2, 2]
    assert torch.equal(gather(parts), x)
    pair = (torch.randn(5, 2), torch.arange(5))
    parts = scatter(pair, 2)
    assert all(isinstance(p, tuple) and len(p) == 2 for p in parts)
    joined = gather(parts)
    assert torch.equal(joined[0], pair[0]) and torch.equal(joined[1], pair[1])

"""Micro-batch scatter and gather of a 256x1024 batch: pytest bench/bench_microbatch.py
--benchmark-only."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpipe_fast.nn.microbatch import gather, scatter

CHUNKS = [8, 32]


@pytest.fixture
def batch() -> torch.Tensor:
    return torch.randn(256, 1024)


@pytest.mark.parametrize("chunks", CHUNKS)
def test_scatter(benchmark: Any, batch: torch.Tensor, chunks: int) -> None:
    pieces = benchmark(scatter, batch, chunks)
    assert len(pieces) == chunks


@pytest.mark.parametrize("chunks", CHUNKS)
def test_gather(benchmark: Any, batch: torch.Tensor, chunks: int) -> None:
    pieces = scatter(batch, chunks)
    joined = benchmark(gather, pieces)
    assert isinstance(joined, torch.Tensor) and joined.shape == batch.shape

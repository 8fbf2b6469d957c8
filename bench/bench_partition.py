"""Partitioner speed on seeded random costs: pytest bench/bench_partition.py --benchmark-only."""

from __future__ import annotations

import random

import pytest

from gpipe_fast.balancing.balance import partition

SHAPES = [(1000, 8), (5000, 100), (5000, 500)]


def random_costs(layers: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(0.1, 1.0) for _ in range(layers)]


@pytest.mark.parametrize(("layers", "cells"), SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_partition(benchmark, layers: int, cells: int) -> None:  # type: ignore[no-untyped-def]
    costs = random_costs(layers)
    balance = benchmark(partition, costs, cells)
    assert len(balance) == cells and sum(balance) == layers

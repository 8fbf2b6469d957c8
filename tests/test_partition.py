"""The partitioner against a brute force: exact min-max cuts, ties to even cells, bad input."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

import gpipe_fast as gf


def cell_sums(costs: list[float], balance: list[int]) -> list[Fraction]:
    """Exact cell costs (Fractions hold every float exactly, so no rounding decides a test)."""
    sums, start = [], 0
    for size in balance:
        sums.append(sum((Fraction(c) for c in costs[start : start + size]), Fraction(0)))
        start += size
    return sums


def best_key(costs: list[float], k: int) -> tuple[Fraction, Fraction]:
    """The least (largest cell, sum of squared cells) over every contiguous split."""
    n = len(costs)
    keys = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        sums = cell_sums(costs, [b - a for a, b in itertools.pairwise(bounds)])
        keys.append((max(sums), sum(s * s for s in sums)))
    return min(keys)


def key_of(costs: list[float], balance: list[int]) -> tuple[Fraction, Fraction]:
    sums = cell_sums(costs, balance)
    return max(sums), sum(s * s for s in sums)


def random_case(rng: random.Random) -> tuple[list[int], int]:
    n = rng.randint(1, 9)
    return [rng.randint(0, 9) for _ in range(n)], rng.randint(1, n)


@pytest.mark.parametrize("scale", [1.0, 2.0**-60, 2.0**40], ids=["unit", "tiny", "huge"])
def test_exact_against_brute_force(scale: float) -> None:
    # Small integers times a power of two: every sum is exact in floats too, so the native
    # result must match the brute force exactly, bottleneck and tie-break alike. The tiny scale
    # guards against slack in absolute terms (costs in seconds are small numbers).
    rng = random.Random(20240601)
    for _ in range(400):
        ints, k = random_case(rng)
        costs = [c * scale for c in ints]
        balance = gf.partition(costs, k)
        assert len(balance) == k and sum(balance) == len(costs) and min(balance) >= 1
        assert key_of(costs, balance) == best_key(costs, k), (costs, k, balance)


def test_random_floats_reach_the_optimal_bottleneck() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.random() * rng.choice([1e-9, 1.0, 1e9]) for _ in range(n)]
        got = max(cell_sums(costs, gf.partition(costs, k)))
        want = best_key(costs, k)[0]
        assert got <= want * (1 + Fraction(1, 10**12)), (costs, k)


@pytest.mark.parametrize(
    ("costs", "k", "want"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([1] * 6, 3, [2, 2, 2]),
        ([2, 1, 1, 2], 2, [2, 2]),
        ([5, 1, 1, 1, 1, 1], 2, [1, 5]),
        ([1, 9, 1, 1, 1, 9, 1], 3, [2, 3, 2]),
        ([3.0], 1, [1]),
        ([4, 2, 7], 3, [1, 1, 1]),
        ([4, 2, 7], 1, [3]),
    ],
)
def test_known_splits(costs: list[float], k: int, want: list[int]) -> None:
    assert gf.partition(costs, k) == want


@pytest.mark.parametrize(
    ("costs", "k", "want"),
    [
        # [1, 1, 3], [1, 2, 2] and [1, 3, 1] all reach the bottleneck 4; [1, 2, 2] is the evenest.
        ([4, 1, 1, 1, 1], 3, [1, 2, 2]),
        # Bottleneck 6 is reached by [1, x, 6 - x] for every x; x = 3 is the evenest.
        ([6, 1, 1, 1, 1, 1, 1], 3, [1, 3, 3]),
        ([1, 1, 1, 1, 1, 1, 6], 3, [3, 3, 1]),
    ],
)
def test_ties_go_to_the_evenest_split(costs: list[float], k: int, want: list[int]) -> None:
    assert gf.partition(costs, k) == want


def test_accepts_any_sequence_of_reals() -> None:
    assert gf.partition((1, 2.5, 3), 2) == [2, 1]
    assert gf.partition(iter([1, 1]), 2) == [1, 1]


def test_many_layers() -> None:
    rng = random.Random(3)
    costs = [rng.random() for _ in range(2000)]
    balance = gf.partition(costs, 50)
    assert len(balance) == 50 and sum(balance) == 2000 and min(balance) >= 1
    # No cell can be much above the average for uniform random costs.
    assert max(cell_sums(costs, balance)) < 1.2 * sum(costs) / 50


@pytest.mark.parametrize(
    ("costs", "k", "error", "match"),
    [
        ([], 1, ValueError, "costs must not be empty"),
        ([1.0, math.nan], 1, ValueError, r"costs\[1\] = nan"),
        ([1.0, math.inf], 1, ValueError, r"costs\[1\] = inf"),
        ([1.0, -1.0], 1, ValueError, r"costs\[1\] = -1"),
        ([1.0, "2"], 1, TypeError, r"costs\[1\]"),
        ([1.0, None], 1, TypeError, r"costs\[1\]"),
        ([True], 1, TypeError, r"costs\[0\]"),
        ("12", 1, TypeError, "costs"),
        (3.0, 1, TypeError, "costs"),
        ([1.0, 2.0], 0, ValueError, "k must be >= 1"),
        ([1.0, 2.0], -2, ValueError, "k must be >= 1"),
        ([1.0, 2.0], 3, ValueError, r"k \(3\) must not exceed the number of layers \(2\)"),
        ([1.0, 2.0], 1.0, TypeError, "k must be an int"),
        ([1.0, 2.0], True, TypeError, "k must be an int"),
        ([1.0, 2.0], None, TypeError, "k must be an int"),
    ],
)
def test_bad_input(costs: object, k: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        gf.partition(costs, k)  # type: ignore[arg-type]

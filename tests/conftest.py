"""Shared fixtures: fresh seeds, pipes closed after each test so workers never pile up, and
the persistent gloo workers of the multi-process tests (one set per test module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cluster import Cluster

import gpipe_fast as gf


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="run the long forms of the harnesses (test_exact_models.py: every checkpoint "
        "mode, and gloo as well as shared memory between processes)",
    )


@pytest.fixture
def full(request: pytest.FixtureRequest) -> bool:
    """Whether `--full` asked for the long form of a harness."""
    return bool(request.config.getoption("--full"))


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(1234)


@pytest.fixture
def make_pipe() -> Iterator[type[gf.GPipe]]:
    """Builds GPipe instances like the constructor and closes them at teardown."""
    pipes: list[gf.GPipe] = []

    def build(*args: object, **kwargs: object) -> gf.GPipe:
        pipe = gf.GPipe(*args, **kwargs)  # type: ignore[arg-type]
        pipes.append(pipe)
        return pipe

    yield build  # type: ignore[misc]
    for pipe in pipes:
        pipe.close()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def two() -> Iterator[Cluster]:
    """Two gloo workers, reused by the module's tests."""
    cluster = Cluster(2)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def four() -> Iterator[Cluster]:
    """Four gloo workers, reused by the module's tests."""
    cluster = Cluster(4)
    yield cluster
    cluster.close()

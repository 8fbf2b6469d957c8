"""Shared fixtures: fresh seeds, pipes closed after each test so workers never pile up, the
persistent gloo workers of the multi-process tests (one set per test module), older objects
kept out of the garbage collector's scans, and the choice between the fast suite (the default)
and the full one (--full, or GPIPE_FAST_FULL_TESTS=1)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch
from cluster import Cluster
from slow_cases import is_slow

import gpipe_fast as gf

# CI sets it: .ci/run replays the README's `pytest` line as it is, so it cannot add --full.
FULL_ENV = "GPIPE_FAST_FULL_TESTS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="run the full suite: the tests marked slow too (long parametrised sweeps, soaks, "
        "sanitizer builds) and the long forms of the harnesses (test_exact_models.py: every "
        f"checkpoint mode, and gloo as well as shared memory). {FULL_ENV}=1 does the same",
    )


def full_suite(config: pytest.Config) -> bool:
    """Whether this run is the full suite: --full, or GPIPE_FAST_FULL_TESTS set (not 0)."""
    return bool(config.getoption("--full")) or os.environ.get(FULL_ENV, "") not in ("", "0")


def pytest_report_header(config: pytest.Config) -> str:
    if full_suite(config):
        return "gpipe_fast: the full suite"
    return (
        "gpipe_fast: the fast suite; the tests marked slow are deselected "
        f"(pytest --full, or {FULL_ENV}=1, runs them)"
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)
    # `-m slow` asks for them by name: the selection is the user's, not the fast suite's.
    if full_suite(config) or "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


@pytest.fixture
def full(request: pytest.FixtureRequest) -> bool:
    """Whether this is the full suite, which runs the long form of a harness."""
    return full_suite(request.config)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(1234)


@pytest.fixture(scope="module", autouse=True)
def _older_objects_frozen() -> None:
    """What is alive when a test module starts (torch's, transformers' and the earlier
    modules' objects: millions) is left out of the garbage collector's scans from then on
    (gc.freeze), after the garbage of the modules before is collected. The tests' own
    gc.collect() calls (counting threads and objects, checking that a failed step's tensors
    are freed) then scan what the module made: a full scan took 0.2 to 0.4 s, three in each
    of test_faults.py's 150 cases."""
    gc.collect()
    gc.freeze()


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

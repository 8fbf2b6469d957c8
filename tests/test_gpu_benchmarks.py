"""The GPU benchmark scripts (bench/gpu_*.py) on CPU: the numbers they report (medians,
ratios, the memory estimate, the largest-model search) and a smoke run of each script."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf

from helpers import RaiseInBackward

# The scripts import their siblings (reporting, gpu_harness, ...) from bench/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import gpu_all
import gpu_copy_bandwidth
import gpu_harness
import gpu_largest_model
import gpu_peak_memory
import gpu_recompute_pool
import gpu_step_overhead
import gpu_transformers
import reporting

# -- medians and ratios -------------------------------------------------------------------------


def test_medians_ratios_and_verdicts() -> None:
    assert reporting.median([3.0, 1.0, 2.0]) == 2.0
    assert math.isnan(reporting.median([]))
    assert reporting.ratio(3.0, 2.0) == 1.5
    assert math.isnan(reporting.ratio(1.0, 0.0))
    assert math.isnan(reporting.ratio(None, 1.0))
    assert math.isnan(reporting.ratio(math.nan, 1.0))
    # Per-round ratios 2, 2, 3: their median, not the ratio of medians (4 / 2).
    assert reporting.paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0
    with pytest.raises(ValueError):
        reporting.paired_ratio([1.0], [1.0, 2.0])
    assert reporting.verdict(1.01, 1.02, at_most=True) == "met"
    assert reporting.verdict(3.9, 4.0, at_most=False) == "NOT met"
    assert reporting.verdict(math.nan, 4.0, at_most=False) == "not measured"


def test_rounds_rotate_the_order_and_drop_the_warmup() -> None:
    calls: list[str] = []

    def contender(name: str) -> Callable[[], float]:
        def run() -> float:
            calls.append(name)
            return float(len(calls))

        return run

    samples = gpu_harness.interleaved_rounds(
        {name: contender(name) for name in "abc"}, rounds=3, warmup=1
    )
    assert "".join(calls) == "abc" + "bca" + "cab" + "abc"
    # Call numbers: the warm-up round (1-3) is dropped; a ran 6th, 8th and 10th.
    assert samples == {"a": [6.0, 8.0, 10.0], "b": [4.0, 9.0, 11.0], "c": [5.0, 7.0, 12.0]}


def test_copy_bandwidth_arithmetic() -> None:
    mib = reporting.MIB
    assert gpu_copy_bandwidth.gigabytes_per_second(500_000_000, 2, 0.5) == 2.0
    # Small copies are timed in batches of about 64 MiB, at most 64 copies.
    assert gpu_copy_bandwidth.copy_batch(mib, 64 * mib, 64) == 64
    assert gpu_copy_bandwidth.copy_batch(16 * mib, 64 * mib, 64) == 4
    assert gpu_copy_bandwidth.copy_batch(2**30, 64 * mib, 64) == 1


# -- the memory estimate ------------------------------------------------------------------------


MODEL = gpu_peak_memory.MemoryModel(
    weights_and_grads_bytes=1000,
    boundary_bytes_per_sample=4,
    activation_bytes_per_sample_per_layer=10,
    layers=8,
    batch=16,
)


def test_estimate_per_mode_by_hand() -> None:
    estimate = gpu_peak_memory.estimate_bytes
    # K = 2 cells, M = 4 micro-batches: stash = 2 x 16 x 4 = 128, a micro-batch is 4 samples.
    assert estimate(MODEL, "plain", 2, 4) == 1000 + 8 * 16 * 10
    assert estimate(MODEL, "never", 2, 4) == 1000 + 128 + 8 * 16 * 10
    # One cell (L/K = 4 layers) rebuilding one micro-batch (4 samples): 160.
    assert estimate(MODEL, "always", 2, 4) == 1000 + 128 + 160
    assert estimate(MODEL, "always", 2, 4, rebuilding_cells=2) == 1000 + 128 + 320
    # The last micro-batch through all 8 layers (320) outweighs one cell's rebuild.
    assert estimate(MODEL, "except_last", 2, 4) == 1000 + 128 + 320


def test_always_follows_the_papers_n_plus_l_over_k_times_n_over_m() -> None:
    def activations(cells: int, chunks: int) -> float:
        stash = cells * MODEL.batch * MODEL.boundary_bytes_per_sample
        return gpu_peak_memory.estimate_bytes(MODEL, "always", cells, chunks) - 1000 - stash

    assert activations(1, 1) == 8 * 16 * 10
    assert activations(2, 1) == activations(1, 1) / 2
    assert activations(2, 8) == activations(1, 1) / 16
    with pytest.raises(ValueError):
        gpu_peak_memory.estimate_bytes(MODEL, "sometimes", 2, 4)
    with pytest.raises(ValueError):
        gpu_peak_memory.estimate_bytes(MODEL, "always", 2, 4, rebuilding_cells=3)


# -- the largest-model search -------------------------------------------------------------------


def _limit(limit: int) -> Callable[[int], bool]:
    return lambda depth: depth <= limit


def test_search_finds_the_exact_limit() -> None:
    result = gpu_largest_model.largest_passing(_limit(137), start=8, maximum=10_000)
    assert (result.largest, result.smallest_failing, result.stopped) == (137, 138, "converged")
    assert all(fits == (depth <= 137) for depth, fits in result.trials)
    assert len(result.trials) <= 2 * math.ceil(math.log2(137)) + 2
    assert result.trials[:5] == [(8, True), (16, True), (32, True), (64, True), (128, True)]


def test_search_stops_within_the_resolution() -> None:
    search = gpu_largest_model.largest_passing
    result = search(_limit(1000), start=8, maximum=10_000, resolution=1 / 32)
    assert result.largest <= 1000 < result.smallest_failing
    assert result.smallest_failing - result.largest <= result.largest // 32
    assert len(result.trials) < len(search(_limit(1000), start=8, maximum=10_000).trials)


def test_search_starting_above_the_limit_bisects_down() -> None:
    result = gpu_largest_model.largest_passing(_limit(137), start=500, maximum=10_000)
    assert result.trials[0] == (500, False)
    assert (result.largest, result.smallest_failing) == (137, 138)


def test_search_when_nothing_fits_or_everything_does() -> None:
    search = gpu_largest_model.largest_passing
    nothing = search(lambda depth: False, start=1, minimum=4, maximum=100)
    assert (nothing.largest, nothing.smallest_failing, nothing.stopped) == (0, 4, "none passed")
    assert nothing.trials == [(4, False)]
    everything = search(lambda depth: True, start=8, maximum=100)
    assert [d for d, _ in everything.trials] == [8, 16, 32, 64, 100]
    assert (everything.largest, everything.smallest_failing) == (100, None)
    assert everything.stopped == "maximum"


def test_search_stops_at_the_deadline_with_a_passing_depth() -> None:
    ticks = iter(range(100))
    result = gpu_largest_model.largest_passing(
        _limit(137), start=8, maximum=10_000, deadline=3, clock=lambda: next(ticks)
    )
    assert result.stopped == "deadline"
    assert len(result.trials) == 4  # the first trial, then one per tick before the deadline
    assert result.largest == 64 and all(fits for _, fits in result.trials)


def test_out_of_memory_is_recognised() -> None:
    oom = gpu_largest_model.is_out_of_memory
    assert oom(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert oom(RuntimeError("CUDA error: out of memory"))
    assert oom(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling x"))
    assert not oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not oom(ValueError("out of memory"))


class _OutOfMemoryBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RaiseInBackward.apply(x, torch.cuda.OutOfMemoryError("CUDA out of memory (bwd)"))


@pytest.mark.parametrize("cells", [0, 2])
def test_a_trial_step_says_does_not_fit_only_for_allocation_failures(
    cells: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A depth "does not fit" only on an allocation failure, and the trial closes its pipe
    (a pipe left open would hold memory and fail the next, smaller depths)."""
    pipes: list[gf.GPipe] = []
    original = gpu_largest_model.make_pipe

    def make_pipe(*args: Any, **kwargs: Any) -> gf.GPipe:
        pipes.append(original(*args, **kwargs))
        return pipes[-1]

    monkeypatch.setattr(gpu_largest_model, "make_pipe", make_pipe)

    def step(*layers: nn.Module) -> tuple[bool, str | None]:
        def build() -> nn.Sequential:
            return nn.Sequential(*layers)

        return gpu_largest_model.try_one_step(build, cells, 2, 4, 3, "sgd", torch.device("cpu"))

    assert step(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)) == (True, None)
    fits, error = step(nn.Linear(3, 3), _OutOfMemoryBackward(), nn.Linear(3, 3))
    assert not fits and error is not None and "out of memory" in error
    with pytest.raises(RuntimeError, match="shapes"):
        step(nn.Linear(3, 3), nn.Linear(5, 3))  # a bug, not a limit: it propagates
    assert len(pipes) == (3 if cells else 0)
    for pipe in pipes:
        with pytest.raises(ValueError, match="closed"):
            pipe(torch.randn(4, 3))


# -- each script, once, on the CPU --------------------------------------------------------------


def _check_step_overhead(section: dict[str, Any]) -> None:
    contenders = section["contenders"]
    assert {"plain", "gpipe K=1 M=1 never", "gpipe K=2 M=2 always"} <= set(contenders)
    for label, entry in contenders.items():
        assert len(entry["samples_s"]) == section["rounds"]
        if label.startswith("gpipe"):  # every pipe computes what the plain module does
            assert entry["max_relative_difference"] < 1e-5, label
    assert section["k1"]["contender"] == "gpipe K=1 M=1 never"


def _check_copy_bandwidth(section: dict[str, Any]) -> None:
    results = section["results"]
    assert [r["bytes"] for r in results] == list(gpu_copy_bandwidth.SCALES["smoke"].sizes)
    assert all(r["bytes_equal"] == {"torch": True} for r in results)
    assert all(r["gbps"]["torch"] > 0 for r in results)


def _check_peak_memory(section: dict[str, Any]) -> None:
    keys = [(r["mode"], r["cells"]) for r in section["results"]]
    assert keys[:2] == [("plain", 1), ("never", 1)]
    assert len(keys) == 1 + 3 * len(gpu_peak_memory.SCALES["smoke"].cells)


def _check_largest_model(section: dict[str, Any]) -> None:
    smoke = gpu_largest_model.SCALES["smoke"]
    plain = section["searches"]["plain"]
    assert plain["largest_depth"] == smoke.max_depth  # no memory limit on the CPU
    assert plain["params"] == smoke.max_depth * section["params_per_block"]


def _check_recompute_pool(section: dict[str, Any]) -> None:
    if section["status"] == "ok":
        assert len(section["results"]) == 2 * 3 * len(gpu_peak_memory.SCALES["smoke"].cells)


def _check_transformers(section: dict[str, Any]) -> None:
    exact = section["exactness"]
    assert exact["loss_relative_difference"] < 1e-12
    assert exact["max_relative_grad_difference"] < 1e-12
    contenders = section["contenders"]
    assert {"plain", "gf.pipeline 1f1b", "plain, compiled blocks"} <= set(contenders)
    compiled = contenders["plain, compiled blocks"]
    # Each block compiled once, and run compiled in every later step of the plain model.
    assert compiled["graphs_compiled"] >= 1
    assert compiled["compiled_runs_per_step"] == gpu_transformers.SCALES["smoke"].layers


SCRIPTS: dict[ModuleType, Callable[[dict[str, Any]], None]] = {
    gpu_step_overhead: _check_step_overhead,
    gpu_copy_bandwidth: _check_copy_bandwidth,
    gpu_peak_memory: _check_peak_memory,
    gpu_largest_model: _check_largest_model,
    gpu_recompute_pool: _check_recompute_pool,
    gpu_transformers: _check_transformers,
}


@pytest.mark.parametrize("script", [*SCRIPTS, gpu_all], ids=lambda s: s.__name__)
def test_without_a_gpu_each_script_exits_2_and_says_why(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script.main([]) == gpu_harness.EXIT_NO_GPU == 2
    assert f"{script.__name__}.py: no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("script", list(SCRIPTS), ids=lambda s: s.__name__)
def test_smoke_run_on_cpu_records_its_measurement(script: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "record.json"
    assert script.main(["--smoke-cpu", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["script"] == f"bench/{script.__name__}.py"
    assert record["environment"]["torch"] == torch.__version__
    assert list(record["sections"]) == [script.NAME]
    section = record["sections"][script.NAME]
    # A build may refuse the recompute pool for CPU cells: then it says so.
    assert section["status"] in (("ok", "unavailable") if script is gpu_recompute_pool else ("ok",))
    SCRIPTS[script](section)


def test_all_runs_the_chosen_measurements_in_order_into_one_record(tmp_path: Path) -> None:
    out = tmp_path / "all.json"
    only = "largest_model,copy_bandwidth"
    assert gpu_all.main(["--smoke-cpu", "--only", only, "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert list(record["sections"]) == ["copy_bandwidth", "largest_model"]  # documented order
    assert record["time_budget_s"] == gpu_all.BUDGET_S["smoke"]
    for name, section in record["sections"].items():
        assert section["status"] == "ok"
        SCRIPTS[gpu_all.SCRIPTS[name]](section)

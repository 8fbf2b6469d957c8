"""CPU checks of bench/gpu_cuda_path.py: estimates, search, tables, records and a smoke run."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C

from helpers import RaiseInBackward


def _load_bench() -> ModuleType:
    # By path: bench/ is not a package, and the script must not be collected as a test.
    path = Path(__file__).resolve().parent.parent / "bench" / "gpu_cuda_path.py"
    spec = importlib.util.spec_from_file_location("gpu_cuda_path", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


# -- numbers and tables -------------------------------------------------------------------------


def test_markdown_table_has_a_header_a_rule_and_one_line_per_row() -> None:
    table = bench.markdown_table(("a", "b"), [(1, "x"), (2.5, None)])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | None |"]
    with pytest.raises(ValueError, match="row 0"):
        bench.markdown_table(("a", "b"), [(1,)])


def test_medians_and_ratios_treat_missing_values_as_not_a_number() -> None:
    assert bench.median([3.0, 1.0, 2.0]) == 2.0
    assert math.isnan(bench.median([]))
    assert bench.ratio(3.0, 2.0) == 1.5
    assert math.isnan(bench.ratio(1.0, 0.0))
    assert math.isnan(bench.ratio(None, 1.0))
    assert math.isnan(bench.ratio(math.nan, 1.0))
    # Per-round ratios 2, 2, 3: their median, not the ratio of medians (4 / 2).
    assert bench.paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0
    with pytest.raises(ValueError):
        bench.paired_ratio([1.0], [1.0, 2.0])


def test_formatting() -> None:
    assert bench.fmt(math.nan) == bench.fmt(None) == "n/a"
    assert bench.fmt(1.234, 1) == "1.2"
    assert bench.fmt_mib(3 * bench.MIB) == "3.0"
    assert bench.fmt_size(bench.MIB) == "1 MiB"
    assert bench.fmt_size(2**30) == "1 GiB"
    assert bench.fmt_size(4096) == "4 KiB"
    assert bench.rotated([1, 2, 3], 4) == [2, 3, 1]
    assert bench.verdict(1.01, 1.02, at_most=True) == "met"
    assert bench.verdict(3.9, 4.0, at_most=False) == "NOT met"
    assert bench.verdict(math.nan, 4.0, at_most=False) == "not measured"


def test_records_are_strict_json(tmp_path: Path) -> None:
    trial = bench.Trial(depth=3, fits=False, seconds=math.inf, peak_allocated=None, error="oom")
    record = {
        "nan": math.nan,
        "pair": (1, 2.0),
        "trial": trial,
        "device": torch.device("cpu"),
        "path": Path("/x"),
        7: "int key",
    }
    assert bench.jsonable(record) == {
        "nan": None,
        "pair": [1, 2.0],
        "trial": {
            "depth": 3,
            "fits": False,
            "seconds": None,
            "peak_allocated": None,
            "error": "oom",
        },
        "device": "cpu",
        "path": "/x",
        "7": "int key",
    }
    out = tmp_path / "deeper" / "record.json"
    bench.write_json(out, record)
    assert json.loads(out.read_text())["trial"]["error"] == "oom"
    assert [p.name for p in out.parent.iterdir()] == ["record.json"]  # no partial file left


def test_default_record_path_is_dated_under_bench_results() -> None:
    path = bench.default_out_path(dt.date(2026, 1, 2))
    assert path.name == "gpu_cuda_path-2026-01-02.json"
    assert path.parent.name == "results"
    assert (path.parent.parent / "gpu_cuda_path.py").is_file()


def test_even_balance() -> None:
    assert bench.even_balance(8, 3) == [3, 3, 2]
    assert bench.even_balance(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        bench.even_balance(3, 4)


# -- the memory estimate ------------------------------------------------------------------------


MODEL = bench.MemoryModel(
    weights_and_grads_bytes=1000,
    boundary_bytes_per_sample=4,
    activation_bytes_per_sample_per_layer=10,
    layers=8,
    batch=16,
)


def test_estimate_per_mode_by_hand() -> None:
    # K = 2 cells, M = 4 micro-batches: stash = 2 x 16 x 4 = 128, a micro-batch is 4 samples.
    assert bench.estimate_bytes(MODEL, "plain", 2, 4) == 1000 + 8 * 16 * 10
    assert bench.estimate_bytes(MODEL, "never", 2, 4) == 1000 + 128 + 8 * 16 * 10
    # One cell (L/K = 4 layers) rebuilding one micro-batch (4 samples): 160.
    assert bench.estimate_bytes(MODEL, "always", 2, 4) == 1000 + 128 + 160
    assert bench.estimate_bytes(MODEL, "always", 2, 4, rebuilding_cells=2) == 1000 + 128 + 320
    # The last micro-batch through all 8 layers (320) outweighs one cell's rebuild.
    assert bench.estimate_bytes(MODEL, "except_last", 2, 4) == 1000 + 128 + 320


def test_always_follows_the_papers_n_plus_l_over_k_times_n_over_m() -> None:
    def activations(cells: int, chunks: int) -> float:
        stash = cells * MODEL.batch * MODEL.boundary_bytes_per_sample
        return bench.estimate_bytes(MODEL, "always", cells, chunks) - 1000 - stash

    assert activations(1, 1) == 8 * 16 * 10
    assert activations(2, 1) == activations(1, 1) / 2
    assert activations(2, 8) == activations(1, 1) / 16
    with pytest.raises(ValueError):
        bench.estimate_bytes(MODEL, "sometimes", 2, 4)
    with pytest.raises(ValueError):
        bench.estimate_bytes(MODEL, "always", 2, 4, rebuilding_cells=3)


# -- the search ---------------------------------------------------------------------------------


def _limit(limit: int):  # type: ignore[no-untyped-def]
    return lambda depth: depth <= limit


def _consistent(result, limit: int) -> None:  # type: ignore[no-untyped-def]
    for depth, fits in result.trials:
        assert fits == (depth <= limit)


def test_search_finds_the_exact_limit() -> None:
    result = bench.largest_passing(_limit(137), start=8, maximum=10_000)
    assert (result.largest, result.smallest_failing, result.stopped) == (137, 138, "converged")
    _consistent(result, 137)
    assert len(result.trials) <= 2 * math.ceil(math.log2(137)) + 2
    assert result.trials[:5] == [(8, True), (16, True), (32, True), (64, True), (128, True)]


def test_search_stops_within_the_resolution() -> None:
    result = bench.largest_passing(_limit(1000), start=8, maximum=10_000, resolution=1 / 32)
    assert result.largest <= 1000 < result.smallest_failing
    assert result.smallest_failing - result.largest <= result.largest // 32
    exact = bench.largest_passing(_limit(1000), start=8, maximum=10_000)
    assert len(result.trials) < len(exact.trials)


def test_search_starting_above_the_limit_bisects_down() -> None:
    result = bench.largest_passing(_limit(137), start=500, maximum=10_000)
    assert result.trials[0] == (500, False)
    assert (result.largest, result.smallest_failing) == (137, 138)


def test_search_when_nothing_fits_or_everything_does() -> None:
    nothing = bench.largest_passing(lambda depth: False, start=1, minimum=4, maximum=100)
    assert (nothing.largest, nothing.smallest_failing, nothing.stopped) == (0, 4, "none passed")
    assert nothing.trials == [(4, False)]
    everything = bench.largest_passing(lambda depth: True, start=8, maximum=100)
    assert [d for d, _ in everything.trials] == [8, 16, 32, 64, 100]
    assert (everything.largest, everything.smallest_failing) == (100, None)
    assert everything.stopped == "maximum"


def test_search_stops_at_the_deadline_with_a_passing_depth() -> None:
    ticks = iter(range(100))
    result = bench.largest_passing(
        _limit(137), start=8, maximum=10_000, deadline=3, clock=lambda: next(ticks)
    )
    assert result.stopped == "deadline"
    assert len(result.trials) == 4  # the first trial, then one per tick before the deadline
    assert result.largest == 64 and all(fits for _, fits in result.trials)


# -- interleaving -------------------------------------------------------------------------------


def test_rounds_rotate_the_order_and_drop_the_warmup() -> None:
    calls: list[str] = []

    def contender(name: str):  # type: ignore[no-untyped-def]
        def run() -> float:
            calls.append(name)
            return float(len(calls))

        return run

    samples = bench.interleaved_rounds(
        {name: contender(name) for name in "abc"}, rounds=3, warmup=1
    )
    assert "".join(calls) == "abc" + "bca" + "cab" + "abc"
    # Call numbers: the warm-up round (1-3) is dropped; a ran 6th, 8th and 10th.
    assert samples == {"a": [6.0, 8.0, 10.0], "b": [4.0, 9.0, 11.0], "c": [5.0, 7.0, 12.0]}


def test_rounds_stop_at_the_deadline_after_the_minimum() -> None:
    clock = iter(range(100))
    samples = bench.interleaved_rounds(
        {"a": lambda: 1.0},
        rounds=50,
        warmup=2,
        min_rounds=3,
        deadline=0,
        clock=lambda: next(clock),
    )
    assert samples == {"a": [1.0, 1.0, 1.0]}


# -- one training step, and allocation failures ------------------------------------------------


class _OutOfMemoryForward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class _OutOfMemoryBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RaiseInBackward.apply(x, torch.cuda.OutOfMemoryError("CUDA out of memory (bwd)"))


def test_out_of_memory_is_recognised() -> None:
    assert bench.is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert bench.is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert bench.is_out_of_memory(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling x"))
    assert not bench.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not bench.is_out_of_memory(ValueError("out of memory"))


def _step(build, cells: int):  # type: ignore[no-untyped-def]
    return bench.try_one_step(build, cells, 2, 4, 3, "sgd", torch.device("cpu"))


@pytest.fixture
def built_pipes(monkeypatch: pytest.MonkeyPatch) -> list[gf.GPipe]:
    """The pipes try_one_step builds, to check it closed them."""
    pipes: list[gf.GPipe] = []

    def make_pipe(*args: object, **kwargs: object) -> gf.GPipe:
        pipes.append(original(*args, **kwargs))
        return pipes[-1]

    original = bench.make_pipe
    monkeypatch.setattr(bench, "make_pipe", make_pipe)
    return pipes


def _closed(pipe: gf.GPipe) -> bool:
    try:
        pipe(torch.randn(4, 3))
    except ValueError as error:
        return "closed" in str(error)
    return False


@pytest.mark.parametrize("cells", [0, 1, 2])
@pytest.mark.parametrize("failing", [_OutOfMemoryForward, _OutOfMemoryBackward])
def test_an_allocation_failure_is_a_no_and_closes_the_pipe(
    cells: int, failing: type[nn.Module], built_pipes: list[gf.GPipe]
) -> None:
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(3, 3), failing(), nn.Linear(3, 3))

    fits, error = _step(build, cells)
    assert not fits
    assert error is not None and "out of memory" in error
    assert len(built_pipes) == (1 if cells else 0)
    assert all(_closed(pipe) for pipe in built_pipes)


def test_other_errors_propagate_and_close_the_pipe(built_pipes: list[gf.GPipe]) -> None:
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(3, 3), nn.Linear(5, 3))  # shapes do not chain

    with pytest.raises(RuntimeError, match="shapes"):
        _step(build, 2)
    assert len(built_pipes) == 1 and _closed(built_pipes[0])


def _seeded_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))


@pytest.mark.parametrize("cells", [0, 2])
def test_a_step_that_fits_trains_the_model(cells: int) -> None:
    initial = [p.detach().clone() for p in _seeded_model().parameters()]
    built: list[nn.Sequential] = []

    def build() -> nn.Sequential:
        built.append(_seeded_model())
        return built[-1]

    assert _step(build, cells) == (True, None)
    trained = list(built[0].parameters())
    assert all(not torch.equal(a, b) for a, b in zip(initial, trained, strict=True))


# -- copies on the CPU --------------------------------------------------------------------------


def test_copy_helpers() -> None:
    src, dst = torch.arange(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    bench.make_copy_launcher("torch", dst, src, None)()
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="CUDA stream"):
        bench.make_copy_launcher("gpipe_fast", dst, src, None)
    with pytest.raises(ValueError, match="size"):
        bench.make_copy_launcher("torch", torch.zeros(8, dtype=torch.uint8), src, None)
    assert bench.copy_batch(bench.MIB, 64 * bench.MIB, 64) == 64
    assert bench.copy_batch(16 * bench.MIB, 64 * bench.MIB, 64) == 4
    assert bench.copy_batch(2**30, 64 * bench.MIB, 64) == 1
    assert bench.gigabytes_per_second(500_000_000, 2, 0.5) == 2.0


# -- the command line ---------------------------------------------------------------------------


def test_sections_are_validated_and_kept_in_order() -> None:
    assert bench.parse_sections("pool, overhead") == ["overhead", "pool"]
    with pytest.raises(Exception, match="unknown section"):
        bench.parse_sections("overhead,bogus")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--sections", "bogus"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        bench.main(["--memory-fraction", "1.5"])


def test_without_a_gpu_it_exits_2_and_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == bench.EXIT_NO_GPU == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_environment_on_cpu() -> None:
    env = bench.environment(torch.device("cpu"))
    assert env["torch"] == torch.__version__
    assert env["gpipe_fast"]["boundary_copier"] == hasattr(_C, "BoundaryCopier")
    assert env["gpipe_fast"]["cuda_compiled"] == _C.cuda_compiled()
    assert "| torch |" in bench.environment_table(env)


def test_smoke_run_records_every_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "smoke.json"
    assert bench.main(["--smoke-cpu", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert list(record["sections"]) == list(bench.SECTIONS)
    statuses = {name: entry["status"] for name, entry in record["sections"].items()}
    pool = statuses.pop("pool")
    assert statuses == {"overhead": "ok", "copies": "ok", "memory": "ok", "largest": "ok"}
    # A build with the option may still refuse the pool for CPU cells: then it is unavailable.
    assert pool in (("ok", "unavailable") if bench.supports_recompute_pool() else ("unavailable",))

    overhead = record["sections"]["overhead"]["contenders"]
    assert {"plain", "gpipe K=1 M=1 never", "gpipe K=2 M=2 always"} <= set(overhead)
    for label, entry in overhead.items():
        assert len(entry["samples_s"]) == record["sections"]["overhead"]["rounds"]
        if label.startswith("gpipe"):  # every pipe computes what the plain module does
            assert entry["max_relative_difference"] < 1e-5, label

    copies = record["sections"]["copies"]["results"]
    assert [c["bytes"] for c in copies] == list(bench.SCALES["smoke"].copies.sizes)
    assert all(c["bytes_equal"] == {"torch": True} for c in copies)

    memory = record["sections"]["memory"]["results"]
    assert [(r["mode"], r["cells"]) for r in memory][:2] == [("plain", 1), ("never", 1)]

    largest = record["sections"]["largest"]["searches"]
    smoke = bench.SCALES["smoke"].largest
    assert largest["plain"]["largest_depth"] == smoke.max_depth  # no memory limit on CPU
    assert largest["plain"]["params"] == smoke.max_depth * bench.params_per_block(smoke.width)

    printed = capsys.readouterr().out
    assert "| contender | median ms |" in printed and "| model | largest depth |" in printed


def test_a_failing_pipe_search_keeps_the_plain_result_and_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_pipe(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(bench, "make_pipe", broken_pipe)
    out = tmp_path / "r.json"
    assert bench.main(["--smoke-cpu", "--sections", "largest", "--out", str(out)]) == 1
    section = json.loads(out.read_text())["sections"]["largest"]
    assert section["status"] == "error"
    assert section["searches"]["plain"]["largest_depth"] == bench.SCALES["smoke"].largest.max_depth
    assert section["searches"]["gpipe K=1 M=2 always"]["error"] == "RuntimeError: boom"


def test_a_failing_copier_is_reported_without_stopping_the_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_launcher(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no such copy")

    monkeypatch.setattr(bench, "make_copy_launcher", broken_launcher)
    out = tmp_path / "r.json"
    assert bench.main(["--smoke-cpu", "--sections", "copies", "--out", str(out)]) == 1
    section = json.loads(out.read_text())["sections"]["copies"]
    assert section["status"] == "error"
    assert section["failed"] == {"torch": "RuntimeError: no such copy"}
    assert len(section["results"]) == len(bench.SCALES["smoke"].copies.sizes)

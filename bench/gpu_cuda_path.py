"""GPU verification of gpipe_fast's CUDA path (issue 3): overhead, copies, peak memory, capacity."""

from __future__ import annotations

import argparse
import datetime as dt
import faulthandler
import gc
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("overhead", "copies", "memory", "largest", "pool")
CHECKPOINT_MODES = ("never", "except_last", "always")
COPIERS = ("gpipe_fast", "cupy", "torch")
MIB = 2**20
EXIT_NO_GPU = 2
OVERHEAD_TARGET = 1.02  # GPipe with one cell may cost at most 2% over the plain module
CAPACITY_TARGET = 4.0  # parameters of the largest GPipe model / those of the plain module
# Messages of allocation failures that do not arrive as torch.cuda.OutOfMemoryError (cuBLAS
# workspaces, raw cudaMalloc in a native pool).
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


# -- pure helpers (exercised on CPU by tests/test_bench_gpu.py) -------------------------------


def median(values: Sequence[float]) -> float:
    """Median, NaN for no values."""
    return statistics.median(values) if values else math.nan


def _is_number(value: float | None) -> bool:
    return value is not None and not math.isnan(value) and not math.isinf(value)


def ratio(numerator: float | None, denominator: float | None) -> float:
    """numerator / denominator, NaN when either is missing or the denominator is 0."""
    if not (_is_number(numerator) and _is_number(denominator)) or denominator == 0:
        return math.nan
    return numerator / denominator  # type: ignore[operator]


def paired_ratio(samples: Sequence[float], reference: Sequence[float]) -> float:
    """Median over rounds of sample / reference within the same round (rounds aligned)."""
    if len(samples) != len(reference):
        raise ValueError(f"{len(samples)} samples against {len(reference)} reference samples")
    return median([ratio(s, r) for s, r in zip(samples, reference, strict=True)])


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """`items` rotated left by `shift`: each round starts with a different contender."""
    if not items:
        return []
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def fmt(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if _is_number(value) else "n/a"


def fmt_mib(nbytes: float | None) -> str:
    return fmt(None if nbytes is None else nbytes / MIB, 1)


def fmt_size(nbytes: int) -> str:
    if nbytes >= 2**30 and nbytes % 2**30 == 0:
        return f"{nbytes // 2**30} GiB"
    if nbytes >= MIB and nbytes % MIB == 0:
        return f"{nbytes // MIB} MiB"
    return f"{nbytes // 1024} KiB" if nbytes % 1024 == 0 else f"{nbytes} B"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; every row must have one cell per header."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"row {i} has {len(row)} cells for {len(headers)} headers")
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def jsonable(value: Any) -> Any:
    """`value` with only JSON types: NaN and infinities become None (strict JSON has neither),
    tuples lists, dataclasses dicts, devices and paths strings."""
    if is_dataclass(value) and not isinstance(value, type):
        return jsonable(asdict(value))
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, float):
        return value if _is_number(value) else None
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    return str(value)


def default_out_path(today: dt.date) -> Path:
    return REPO / "bench" / "results" / f"gpu_cuda_path-{today.isoformat()}.json"


def write_json(path: Path, record: Mapping[str, Any]) -> None:
    """Writes `record` to `path` through a temporary file, so a run killed mid-write keeps the
    previous complete record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(jsonable(record), indent=2, allow_nan=False) + "\n")
    os.replace(partial, path)


def even_balance(layers: int, cells: int) -> list[int]:
    """Near-equal layers per cell, the larger cells first."""
    if cells < 1 or layers < cells:
        raise ValueError(f"cannot cut {layers} layers into {cells} cells")
    return [layers // cells + (k < layers % cells) for k in range(cells)]


def interleaved_rounds(
    contenders: Mapping[str, Callable[[], float]],
    *,
    rounds: int,
    warmup: int = 0,
    min_rounds: int = 1,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_round: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Runs every contender once per round, the order rotated by one each round; each returns
    the seconds it measured. After `warmup` unrecorded rounds, records up to `rounds` rounds,
    stopping early once `deadline` (on `clock`) has passed and `min_rounds` are recorded."""
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    recorded = 0
    for round_ in range(warmup + rounds):
        for name in rotated(names, round_):
            seconds = contenders[name]()
            if round_ >= warmup:
                samples[name].append(seconds)
        if round_ >= warmup:
            recorded += 1
        if on_round is not None:
            on_round(round_ + 1, warmup + rounds)
        if deadline is not None and clock() >= deadline and recorded >= min_rounds:
            break
    return samples


@dataclass(frozen=True)
class MemoryModel:
    """What the peak-memory estimates are made of, all measured on the plain model."""

    weights_and_grads_bytes: int  # parameters + their gradients
    boundary_bytes_per_sample: float  # one sample of a cell's input
    activation_bytes_per_sample_per_layer: float  # kept for backward by one layer
    layers: int
    batch: int


def estimate_bytes(
    model: MemoryModel, mode: str, cells: int, chunks: int, *, rebuilding_cells: int = 1
) -> float:
    """Peak bytes of one training step, after the GPipe paper's O(N + (L/K) x (N/M)).

    - "plain": weights and gradients + all layers' activations for the whole batch.
    - "never": the same plus the stashed cell inputs (N samples x boundary x K cells).
    - "always": weights and gradients + stashed cell inputs + the activations that
      `rebuilding_cells` cells rebuild at once, each for one micro-batch through its L/K layers
      (the paper counts one: one cell per accelerator; K cells sharing one GPU may rebuild
      concurrently, up to K).
    - "except_last": weights and gradients + stashed inputs + the last micro-batch's
      activations through all L layers, kept at the end of the forward (its backward runs
      first and frees them), or the rebuilt activations if more.
    """
    if cells < 1 or chunks < 1 or not 1 <= rebuilding_cells <= cells:
        raise ValueError(f"cells={cells}, chunks={chunks}, rebuilding_cells={rebuilding_cells}")
    fixed = model.weights_and_grads_bytes
    per_layer_sample = model.activation_bytes_per_sample_per_layer
    whole_batch = model.layers * model.batch * per_layer_sample
    if mode == "plain":
        return fixed + whole_batch
    stash = cells * model.batch * model.boundary_bytes_per_sample
    if mode == "never":
        return fixed + stash + whole_batch
    micro_batch = model.batch / chunks
    rebuilt = rebuilding_cells * (model.layers / cells) * micro_batch * per_layer_sample
    if mode == "always":
        return fixed + stash + rebuilt
    if mode == "except_last":
        last_micro_batch = model.layers * micro_batch * per_layer_sample
        return fixed + stash + max(last_micro_batch, rebuilt)
    raise ValueError(f"unknown mode {mode!r}")


@dataclass
class SearchResult:
    """Outcome of largest_passing."""

    largest: int  # largest value that passed; 0 when none did
    smallest_failing: int | None  # smallest value that failed; None when none did
    trials: list[tuple[int, bool]]
    stopped: str  # "converged", "maximum" (it passed), "deadline" or "none passed"


def largest_passing(
    passes: Callable[[int], bool],
    *,
    start: int,
    maximum: int,
    minimum: int = 1,
    resolution: float = 0.0,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SearchResult:
    """The largest integer in [minimum, maximum] for which `passes` holds, assuming it holds up
    to some value and not beyond. Doubles from `start` until a value fails (or `maximum`
    passes), then bisects until the gap between the largest passing and the smallest failing
    value is at most max(1, resolution x largest passing). Past `deadline`, stops with the
    bracket found so far (the first trial always runs)."""
    if not 1 <= minimum <= maximum:
        raise ValueError(f"need 1 <= minimum <= maximum, got {minimum}, {maximum}")
    trials: list[tuple[int, bool]] = []

    def check(value: int) -> bool:
        ok = bool(passes(value))
        trials.append((value, ok))
        return ok

    def out_of_time() -> bool:
        return deadline is not None and clock() >= deadline

    def result(low: int, high: int | None, stopped: str) -> SearchResult:
        largest = low if low >= minimum else 0
        return SearchResult(largest, high, trials, "none passed" if largest == 0 else stopped)

    start = min(max(start, minimum), maximum)
    low, high = minimum - 1, None  # largest known to pass (minimum - 1: none), smallest to fail
    if check(start):
        low = start
        while high is None:
            if low >= maximum:
                return result(low, None, "maximum")
            if out_of_time():
                return result(low, None, "deadline")
            value = min(2 * low, maximum)
            if check(value):
                low = value
            else:
                high = value
    else:
        high = start
    while high - low > max(1, int(low * resolution)):
        if out_of_time():
            return result(low, high, "deadline")
        value = (low + high) // 2
        if check(value):
            low = value
        else:
            high = value
    return result(low, high, "converged")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` reports an allocation failure (gpipe_fast keeps the type of errors
    raised in its cells, adding where they happened to the message)."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in OOM_MARKERS)


def verdict(value: float, target: float, *, at_most: bool) -> str:
    if not _is_number(value):
        return "not measured"
    met = value <= target if at_most else value >= target
    return "met" if met else "NOT met"


# -- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverheadConfig:
    width: int
    blocks: int
    batch: int
    cells: tuple[int, ...]
    chunks: tuple[int, ...]
    checkpoints: tuple[str, ...]
    rounds: int
    warmup: int
    min_rounds: int
    time_box_s: float


@dataclass(frozen=True)
class CopyConfig:
    sizes: tuple[int, ...]  # bytes
    reps: int
    bytes_per_sample: int  # small copies are timed in batches of about this many bytes
    max_batch: int
    time_box_s: float


@dataclass(frozen=True)
class MemoryConfig:
    width: int
    blocks: int
    batch: int
    cells: tuple[int, ...]
    chunks: int
    repeats: int
    time_box_s: float


@dataclass(frozen=True)
class LargestConfig:
    width: int
    batch: int
    chunks: int
    cells: tuple[int, ...]
    start_depth: int
    max_depth: int
    resolution: float
    optimizer: str
    memory_fraction: float
    time_box_s: float


@dataclass(frozen=True)
class Scale:
    name: str
    overhead: OverheadConfig
    copies: CopyConfig
    memory: MemoryConfig
    largest: LargestConfig
    pool_time_box_s: float
    time_budget_s: float  # no section starts after this many seconds


SCALES = {
    "full": Scale(
        name="full",
        overhead=OverheadConfig(
            width=2048,
            blocks=8,
            batch=4096,
            cells=(1, 2, 4),
            chunks=(1, 4, 8),
            checkpoints=("never", "always"),
            rounds=15,
            warmup=2,
            min_rounds=3,
            time_box_s=75,
        ),
        copies=CopyConfig(
            sizes=tuple(MIB * 4**i for i in range(6)),  # 1 MiB .. 1 GiB
            reps=10,
            bytes_per_sample=64 * MIB,
            max_batch=64,
            time_box_s=45,
        ),
        memory=MemoryConfig(
            width=1024, blocks=32, batch=8192, cells=(1, 2, 4), chunks=8, repeats=2, time_box_s=45
        ),
        largest=LargestConfig(
            width=512,
            batch=16384,
            chunks=8,
            cells=(1, 4),
            start_depth=8,
            max_depth=16384,
            resolution=1 / 32,
            optimizer="sgd",
            memory_fraction=0.25,
            time_box_s=120,
        ),
        pool_time_box_s=45,
        time_budget_s=300,
    ),
    "quick": Scale(
        name="quick",
        overhead=OverheadConfig(
            width=1024,
            blocks=4,
            batch=2048,
            cells=(1, 2),
            chunks=(1, 4),
            checkpoints=("never", "always"),
            rounds=6,
            warmup=1,
            min_rounds=3,
            time_box_s=30,
        ),
        copies=CopyConfig(
            sizes=(MIB, 16 * MIB, 256 * MIB),
            reps=5,
            bytes_per_sample=64 * MIB,
            max_batch=64,
            time_box_s=20,
        ),
        memory=MemoryConfig(
            width=512, blocks=16, batch=4096, cells=(1, 4), chunks=8, repeats=1, time_box_s=30
        ),
        largest=LargestConfig(
            width=256,
            batch=8192,
            chunks=8,
            cells=(1,),
            start_depth=8,
            max_depth=16384,
            resolution=1 / 16,
            optimizer="sgd",
            memory_fraction=0.05,
            time_box_s=60,
        ),
        pool_time_box_s=30,
        time_budget_s=180,
    ),
    # CPU only, for tests: every section's code path at toy sizes (no memory statistics).
    "smoke": Scale(
        name="smoke",
        overhead=OverheadConfig(
            width=16,
            blocks=4,
            batch=16,
            cells=(1, 2),
            chunks=(1, 2),
            checkpoints=("never", "always"),
            rounds=1,
            warmup=1,
            min_rounds=1,
            time_box_s=10,
        ),
        copies=CopyConfig(
            sizes=(4096, 65536), reps=2, bytes_per_sample=65536, max_batch=4, time_box_s=5
        ),
        memory=MemoryConfig(
            width=16, blocks=4, batch=16, cells=(1, 2), chunks=2, repeats=1, time_box_s=10
        ),
        largest=LargestConfig(
            width=8,
            batch=8,
            chunks=2,
            cells=(1, 2),
            start_depth=2,
            max_depth=8,
            resolution=0.0,
            optimizer="sgd",
            memory_fraction=1.0,
            time_box_s=10,
        ),
        pool_time_box_s=10,
        time_budget_s=60,
    ),
}


@dataclass
class Context:
    device: torch.device
    scale: Scale
    memory_fraction: float
    started: float = field(default_factory=time.monotonic)


@dataclass
class SectionOutput:
    data: dict[str, Any]
    table: str
    # "ok"; "unavailable": what it measures is missing from this build; "error": a contender
    # failed (the others' results are kept).
    status: str = "ok"


# -- device helpers -----------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Frees what the last trial left on a GPU: cycles (an exception's traceback holds its
    frames' tensors) first, then the caching allocator's free blocks, so the next trial starts
    clean. Nothing to do on the CPU, where nothing is measured."""
    if device.type != "cuda":
        return
    gc.collect()
    synchronize(device)
    torch.cuda.empty_cache()


def timed(step: Callable[[], Any], device: torch.device) -> Callable[[], float]:
    """`step` timed on the host, the device synchronised before and after."""

    def run() -> float:
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        return time.perf_counter() - start

    return run


def _device_used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def peak_of(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Runs `step` once from a clean allocator and returns its peak memory (None on CPU)."""
    release_memory(device)
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device) if on_cuda else None
    start = time.perf_counter()
    extra = step()
    synchronize(device)
    seconds = time.perf_counter() - start
    measured: dict[str, Any] = {
        "seconds": seconds,
        "baseline_allocated": baseline,
        "peak_allocated": torch.cuda.max_memory_allocated(device) if on_cuda else None,
        "peak_reserved": torch.cuda.max_memory_reserved(device) if on_cuda else None,
        # The whole device's use, which also sees memory reserved outside torch's allocator
        # (a native pool's arenas, the CUDA context); not a peak.
        "device_used_after": _device_used(device) if on_cuda else None,
    }
    if isinstance(extra, dict):
        measured.update(extra)
    return measured


# -- models -------------------------------------------------------------------------------------


class MLPBlock(nn.Module):
    """A Transformer's feed-forward block with its residual: x + W2 gelu(W1 x)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def build_stack(blocks: int, width: int, device: torch.device) -> nn.Sequential:
    """`blocks` MLP blocks, created directly on `device` (no host copy of large models)."""
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(*[MLPBlock(width) for _ in range(blocks)])


def params_per_block(width: int) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in MLPBlock(width).parameters())


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def make_pipe(
    module: nn.Sequential,
    cells: int,
    chunks: int,
    checkpoint: str,
    device: torch.device,
    **options: Any,
) -> gf.GPipe:
    return gf.GPipe(
        module,
        even_balance(len(module), cells),
        devices=[device] * cells,
        chunks=chunks,
        checkpoint=checkpoint,
        **options,
    )


def supports_recompute_pool() -> bool:
    return "recompute_pool" in inspect.signature(gf.GPipe.__init__).parameters


def cell_memory_stats(pipe: gf.GPipe) -> list[dict[str, Any]] | None:
    return [dict(stats) for stats in pipe.memory_stats()] if hasattr(pipe, "memory_stats") else None


# -- environment --------------------------------------------------------------------------------


def _run_quietly(command: Sequence[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit() -> dict[str, Any] | None:
    commit = _run_quietly(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    if commit is None:
        return None
    status = _run_quietly(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    return {"commit": commit, "dirty": bool(status)}


def cupy_info() -> dict[str, Any]:
    try:
        import cupy
    except Exception as error:  # ImportError, or a CUDA library it cannot load
        return {"available": False, "reason": f"{type(error).__name__}: {error}"}
    info: dict[str, Any] = {"available": True, "version": cupy.__version__}
    try:
        info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        info["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as error:
        info["runtime_error"] = f"{type(error).__name__}: {error}"
    return info


def driver_version() -> str | None:
    smi = _run_quietly(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi:
        return smi.splitlines()[0].strip()
    return None


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "device": str(device),
        "gpipe_fast": {
            "version": gf.__version__,
            "path": str(Path(gf.__file__).parent),
            "git": git_commit(),
            "cuda_compiled": _C.cuda_compiled(),
            "boundary_copier": hasattr(_C, "BoundaryCopier"),
            "recompute_pool_option": supports_recompute_pool(),
            "memory_stats": hasattr(gf.GPipe, "memory_stats"),
        },
        "cupy": cupy_info(),
        "nvidia_smi_driver": None,
        "gpus": [],
    }
    if torch.cuda.is_available():
        env["nvidia_smi_driver"] = driver_version()
        env["cudnn"] = torch.backends.cudnn.version()
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            env["gpus"].append(
                {
                    "index": index,
                    "name": props.name,
                    "total_memory": props.total_memory,
                    "capability": f"{props.major}.{props.minor}",
                    "multiprocessors": props.multi_processor_count,
                }
            )
    return env


def environment_table(env: Mapping[str, Any]) -> str:
    gpus = "; ".join(
        f"{g['name']} ({g['total_memory'] / 2**30:.0f} GiB, sm {g['capability']})"
        for g in env["gpus"]
    )
    cupy = env["cupy"]
    git = env["gpipe_fast"]["git"]
    commit = f"{git['commit'][:12]}{' (dirty)' if git['dirty'] else ''}" if git else "n/a"
    rows = [
        ("GPUs", gpus or "none"),
        ("driver (nvidia-smi)", env["nvidia_smi_driver"] or "n/a"),
        ("CUDA driver API version (cupy)", cupy.get("cuda_driver", "n/a")),
        ("torch", f"{env['torch']} (CUDA {env['torch_cuda']})"),
        ("cupy", cupy.get("version", "not importable")),
        ("python", env["python"]),
        ("gpipe_fast commit", commit),
        ("gpipe_fast built with CUDA", env["gpipe_fast"]["cuda_compiled"]),
        ("native BoundaryCopier", env["gpipe_fast"]["boundary_copier"]),
        ("GPipe(recompute_pool=...)", env["gpipe_fast"]["recompute_pool_option"]),
        ("float32 matmul precision", env["float32_matmul_precision"]),
    ]
    return markdown_table(("what", "value"), rows)


# -- section 2: overhead of the pipe on one GPU ----------------------------------------------


def overhead_label(cells: int, chunks: int, checkpoint: str) -> str:
    return f"gpipe K={cells} M={chunks} {checkpoint}"


def run_overhead(ctx: Context) -> SectionOutput:
    cfg, device = ctx.scale.overhead, ctx.device
    module = build_stack(cfg.blocks, cfg.width, device)
    x = torch.randn(cfg.batch, cfg.width, device=device)
    pipes: dict[str, tuple[int, int, str, gf.GPipe]] = {}
    try:
        steps: dict[str, Callable[[], float]] = {
            "plain": timed(lambda: module(x).sum().backward(), device)
        }
        for chunks in cfg.chunks:
            if chunks > 1:  # what splitting the batch costs without any pipeline

                def in_turn(chunks: int = chunks) -> None:
                    for micro in x.chunk(chunks):
                        module(micro).sum().backward()

                steps[f"plain, {chunks} micro-batches in turn"] = timed(in_turn, device)
        for cells in cfg.cells:
            for chunks in cfg.chunks:
                for checkpoint in cfg.checkpoints:
                    label = overhead_label(cells, chunks, checkpoint)
                    # Every pipe wraps the same layers: one copy of the weights for all.
                    pipe = make_pipe(module, cells, chunks, checkpoint, device)
                    pipes[label] = (cells, chunks, checkpoint, pipe)
                    steps[label] = timed(lambda pipe=pipe: pipe(x).sum().backward(), device)

        # The pipes must compute what the plain module does before their times mean anything.
        with torch.no_grad():
            want = module(x)
            scale = want.abs().max().item() or 1.0
            differences = {
                label: (pipe(x) - want).abs().max().item() / scale
                for label, (_, _, _, pipe) in pipes.items()
            }
        del want

        deadline = time.monotonic() + cfg.time_box_s
        samples = interleaved_rounds(
            steps,
            rounds=cfg.rounds,
            warmup=cfg.warmup,
            min_rounds=cfg.min_rounds,
            deadline=deadline,
            on_round=lambda done, total: print(f"  round {done}/{total}", flush=True),
        )
    finally:
        for _, _, _, pipe in pipes.values():
            pipe.close()

    plain = median(samples["plain"])
    contenders: dict[str, dict[str, Any]] = {}
    rows = []
    for label, values in samples.items():
        cells, chunks, checkpoint = pipes[label][:3] if label in pipes else (None, None, None)
        entry = {
            "cells": cells,
            "chunks": chunks,
            "checkpoint": checkpoint,
            "samples_s": values,
            "median_s": median(values),
            "vs_plain": ratio(median(values), plain),
            "paired_vs_plain": paired_ratio(values, samples["plain"]),
            "max_relative_difference": differences.get(label),
        }
        contenders[label] = entry
        rows.append(
            (
                label,
                fmt(entry["median_s"] * 1e3, 1),
                fmt(entry["vs_plain"], 3),
                fmt(entry["paired_vs_plain"], 3),
                fmt(entry["max_relative_difference"], 6) if label in pipes else "",
            )
        )
    key = overhead_label(1, 1, "never")
    k1 = contenders.get(key, {}).get("paired_vs_plain", math.nan)
    summary = {
        "contender": key,
        "paired_vs_plain": k1,
        "target_at_most": OVERHEAD_TARGET,
        "verdict": verdict(k1, OVERHEAD_TARGET, at_most=True),
    }
    table = markdown_table(
        ("contender", "median ms", "vs plain", "paired vs plain", "max rel. diff vs plain"), rows
    )
    table += (
        f"\n\nK=1, M=1, checkpoint never: {fmt(k1, 3)} of the plain module's step "
        f"(target <= {OVERHEAD_TARGET}): {summary['verdict']}; "
        f"{len(samples['plain'])} rounds; workload {cfg.blocks} x MLPBlock({cfg.width}), "
        f"batch {cfg.batch}, forward + sum().backward(), synchronised per step"
    )
    return SectionOutput(
        {"config": cfg, "rounds": len(samples["plain"]), "contenders": contenders, "k1": summary},
        table,
    )


# -- section 3: boundary copy bandwidth ------------------------------------------------------


def cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


def _cupy_stream(stream: torch.cuda.Stream) -> Any:
    import cupy

    try:
        return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)
    except TypeError:  # cupy < 10 takes the handle alone
        return cupy.cuda.ExternalStream(stream.cuda_stream)


def enable_peer_access(copier: Any, a: int, b: int) -> dict[str, bool]:
    """Lets each of devices a and b reach the other's memory through the native copier."""
    return {
        f"{a}->{b}": bool(copier.enable_peer_access(a, b)),
        f"{b}->{a}": bool(copier.enable_peer_access(b, a)),
    }


def make_copy_launcher(
    name: str,
    dst: torch.Tensor,
    src: torch.Tensor,
    stream: torch.cuda.Stream | None,
    copier: Any = None,
) -> Callable[[], None]:
    """A call that enqueues one copy of `src` into `dst` on `stream` (its device: dst's), with
    gpipe_fast's native copier, cupy's runtime API on the same stream, or torch's copy_."""
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copies need contiguous tensors")
    nbytes = src.numel() * src.element_size()
    if dst.numel() * dst.element_size() != nbytes:
        raise ValueError("src and dst differ in size")
    dst_ptr, src_ptr = dst.data_ptr(), src.data_ptr()
    if name == "torch":

        def torch_copy() -> None:
            if stream is None:
                dst.copy_(src)
                return
            with torch.cuda.stream(stream):  # on another device torch copies on src's stream
                dst.copy_(src, non_blocking=True)

        return torch_copy
    if stream is None:
        raise ValueError(f"the {name} copier needs a CUDA stream")
    dst_index, src_index = dst.device.index, src.device.index
    if name == "gpipe_fast":
        copier = copier if copier is not None else _C.BoundaryCopier()
        # Consumer and copy stream are one stream here: the copy's own bandwidth is measured.
        native_stream = _C.Stream(stream.device.index, stream.cuda_stream)

        def native_copy() -> None:
            copier.copy(
                dst_ptr, dst_index, src_ptr, src_index, nbytes, native_stream, native_stream
            )

        return native_copy
    if name == "cupy":
        import cupy

        handle = _cupy_stream(stream).ptr
        runtime = cupy.cuda.runtime
        if dst_index == src_index:
            kind = runtime.memcpyDeviceToDevice
            return lambda: runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, handle)
        return lambda: runtime.memcpyPeerAsync(
            dst_ptr, dst_index, src_ptr, src_index, nbytes, handle
        )
    raise ValueError(f"unknown copier {name!r}")


def copy_batch(nbytes: int, bytes_per_sample: int, max_batch: int) -> int:
    """How many copies one timed sample enqueues back to back: small copies take less time
    than the events' resolution, so they are timed in batches."""
    return max(1, min(max_batch, bytes_per_sample // max(nbytes, 1)))


def gigabytes_per_second(nbytes: int, copies: int, seconds: float) -> float:
    return ratio(nbytes * copies / 1e9, seconds)


def _sleep_cycles_per_second(device: torch.device) -> float:
    """GPU clock ticks per second as torch.cuda._sleep counts them, timed with events."""
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(1000)  # warm the kernel up
    start.record(stream)
    torch.cuda._sleep(cycles)
    end.record(stream)
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def time_copies(
    launchers: Mapping[str, Callable[[], None]],
    batch: int,
    reps: int,
    stream: torch.cuda.Stream | None,
    cycles_per_s: float,
) -> dict[str, list[dict[str, float]]]:
    """`reps` samples per contender, interleaved, each of `batch` copies back to back:
    {"gpu_s": event-timed, "host_s": time to enqueue them, "head_start_s": how long the GPU
    was held back while the host enqueued}. Before each sample the stream sleeps on the GPU
    so the host enqueues the whole batch first: the events then time the copies alone, not
    the host's launch gaps (head_start_s < host_s flags a sample where they may show)."""
    names = list(launchers)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    # 1 ms plus 50 us per launch: several times what a launch costs the host.
    head_start_s = 1e-3 + 50e-6 * batch
    for rep in range(reps):
        pending = []
        for name in rotated(names, rep):
            launch = launchers[name]
            if stream is None:  # CPU smoke: host timing only
                start_s = time.perf_counter()
                for _ in range(batch):
                    launch()
                host_s = time.perf_counter() - start_s
                samples[name].append({"gpu_s": host_s, "host_s": host_s, "head_start_s": 0.0})
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(head_start_s * cycles_per_s))
            start.record(stream)
            start_s = time.perf_counter()
            for _ in range(batch):
                launch()
            host_s = time.perf_counter() - start_s
            end.record(stream)
            pending.append((name, start, end, host_s))
        if stream is not None:
            stream.synchronize()  # one round at a time keeps the queue short
            for name, start, end, host_s in pending:
                samples[name].append(
                    {
                        "gpu_s": start.elapsed_time(end) / 1e3,
                        "host_s": host_s,
                        "head_start_s": head_start_s,
                    }
                )
    return samples


def copy_routes(device: torch.device) -> list[tuple[torch.device, torch.device]]:
    """(source, destination): within the device, and to the next GPU when there is one."""
    routes = [(device, device)]
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        routes.append(
            (device, torch.device("cuda", (device.index + 1) % torch.cuda.device_count()))
        )
    return routes


def run_copies(ctx: Context) -> SectionOutput:
    cfg, device = ctx.scale.copies, ctx.device
    on_cuda = device.type == "cuda"
    unavailable: dict[str, str] = {}
    if not on_cuda:
        unavailable["gpipe_fast"] = unavailable["cupy"] = "needs CUDA"
    else:
        if not hasattr(_C, "BoundaryCopier"):
            unavailable["gpipe_fast"] = "gpipe_fast._C has no BoundaryCopier in this build"
        elif not _C.cuda_compiled():
            unavailable["gpipe_fast"] = "gpipe_fast._C was built without CUDA"
        if not cupy_available():
            unavailable["cupy"] = "cupy is not importable"
    names = [name for name in COPIERS if name not in unavailable]
    failed: dict[str, str] = {}  # contenders that raised: left out from then on

    def fail(name: str, error: Exception) -> None:
        failed[name] = f"{type(error).__name__}: {error}"
        print(f"  {name} FAILED: {failed[name]}", flush=True)

    copier = None
    if "gpipe_fast" in names:
        try:
            copier = _C.BoundaryCopier()
        except Exception as error:
            fail("gpipe_fast", error)
    cycles_per_s = _sleep_cycles_per_second(device) if on_cuda else 0.0
    deadline = time.monotonic() + cfg.time_box_s
    results: list[dict[str, Any]] = []
    peers: dict[str, Any] = {}
    rows = []
    for src_device, dst_device in copy_routes(device):
        route = f"{src_device} -> {dst_device}"
        if on_cuda and src_device != dst_device:
            # torch enables peer access for a pair on its first copy between them; doing it
            # here gives every contender the same path (cupy has no call of its own for it).
            torch.zeros(1, device=dst_device).copy_(torch.zeros(1, device=src_device))
            synchronize(dst_device)
            peers[route] = {
                "torch_can_access_peer": torch.cuda.can_device_access_peer(
                    dst_device.index, src_device.index
                ),
                "native_enabled": None,
            }
            if copier is not None and "gpipe_fast" not in failed:
                try:
                    peers[route]["native_enabled"] = enable_peer_access(
                        copier, dst_device.index, src_device.index
                    )
                except Exception as error:
                    fail("gpipe_fast", error)
        stream = torch.cuda.Stream(dst_device) if on_cuda else None
        for nbytes in cfg.sizes:
            if time.monotonic() > deadline:
                print(f"  time box reached: skipping {route} {fmt_size(nbytes)} and larger")
                break
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=src_device)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
            launchers: dict[str, Callable[[], None]] = {}
            for name in names:
                if name not in failed:
                    try:
                        launchers[name] = make_copy_launcher(name, dst, src, stream, copier)
                    except Exception as error:
                        fail(name, error)
            reference = src if src_device == dst_device else src.to(dst_device)
            synchronize(src_device)  # the copies run on `stream`, not where src was written
            equal: dict[str, bool] = {}
            for name, launch in list(launchers.items()):  # each copier must move every byte
                dst.zero_()
                synchronize(dst_device)
                try:
                    launch()
                    if stream is not None:
                        stream.synchronize()
                except Exception as error:
                    fail(name, error)
                    del launchers[name]
                    continue
                equal[name] = torch.equal(dst, reference)
                if not equal[name]:
                    print(f"  MISMATCH: {name} copied {route} {fmt_size(nbytes)} wrongly")
            del reference
            batch = copy_batch(nbytes, cfg.bytes_per_sample, cfg.max_batch)
            samples = time_copies(launchers, batch, cfg.reps, stream, cycles_per_s)
            entry: dict[str, Any] = {
                "route": route,
                "bytes": nbytes,
                "copies_per_sample": batch,
                "bytes_equal": equal,
                "samples": samples,
                "gbps": {},
                "host_us_per_copy": {},
                "host_outran_head_start": {},
            }
            for name, values in samples.items():
                entry["gbps"][name] = median(
                    [gigabytes_per_second(nbytes, batch, v["gpu_s"]) for v in values]
                )
                entry["host_us_per_copy"][name] = median(
                    [v["host_s"] / batch * 1e6 for v in values]
                )
                entry["host_outran_head_start"][name] = (
                    sum(v["host_s"] > v["head_start_s"] for v in values) if on_cuda else 0
                )
            gbps = entry["gbps"]
            entry["gpipe_fast_vs_cupy"] = ratio(gbps.get("gpipe_fast"), gbps.get("cupy"))
            entry["gpipe_fast_vs_torch"] = ratio(gbps.get("gpipe_fast"), gbps.get("torch"))
            results.append(entry)
            rows.append(
                (
                    route,
                    fmt_size(nbytes),
                    *(fmt(gbps.get(name), 1) for name in COPIERS),
                    fmt(entry["gpipe_fast_vs_cupy"], 3),
                    fmt(entry["gpipe_fast_vs_torch"], 3),
                    ", ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in equal.items()),
                    " / ".join(fmt(entry["host_us_per_copy"].get(n), 1) for n in COPIERS),
                )
            )
            print(
                f"  {route} {fmt_size(nbytes)}: "
                + ", ".join(f"{n} {fmt(g, 1)} GB/s" for n, g in gbps.items()),
                flush=True,
            )
            del src, dst, launchers
            release_memory(dst_device)
    table = markdown_table(
        (
            "route",
            "size",
            "gpipe_fast GB/s",
            "cupy GB/s",
            "torch GB/s",
            "gpipe_fast / cupy",
            "gpipe_fast / torch",
            "bytes equal",
            "host us per copy (gf / cupy / torch)",
        ),
        rows,
    )
    if unavailable:
        table += "\n\nnot measured: " + "; ".join(f"{n}: {why}" for n, why in unavailable.items())
    if failed:
        table += "\n\nFAILED: " + "; ".join(f"{n}: {why}" for n, why in failed.items())
    outran = sum(n for entry in results for n in entry["host_outran_head_start"].values())
    timing = "CUDA events, the stream held back while the host enqueued" if on_cuda else "host"
    table += (
        f"\n\nGB/s = 1e9 bytes per second; median of {cfg.reps} samples per cell, each a batch "
        f"of back-to-back copies timed by {timing}; samples whose enqueueing outlasted that "
        f"head start (bandwidth possibly understated): {outran}"
    )
    data = {
        "config": cfg,
        "unavailable": unavailable,
        "failed": failed,
        "peer_access": peers,
        "sleep_cycles_per_s": cycles_per_s,
        "results": results,
    }
    return SectionOutput(data, table, "error" if failed else "ok")


# -- section 4: peak memory per checkpoint mode -----------------------------------------------


def activation_bytes_per_sample_per_layer(
    module: nn.Sequential, x: torch.Tensor, device: torch.device
) -> float | None:
    """Bytes a forward of the plain model keeps for its backward, per sample and layer:
    allocated memory with the graph alive minus before the forward (None on CPU: no stats)."""
    if device.type != "cuda":
        return None
    release_memory(device)
    before = torch.cuda.memory_allocated(device)
    out = module(x)
    synchronize(device)
    after = torch.cuda.memory_allocated(device)
    out.sum().backward()
    del out
    return (after - before) / (len(module) * x.shape[0])


def _pipe_step(pipe: gf.GPipe, x: torch.Tensor) -> Callable[[], dict[str, Any]]:
    def step() -> dict[str, Any]:
        out = pipe(x)
        during = cell_memory_stats(pipe)  # the stash is alive between forward and backward
        out.sum().backward()
        del out
        return {
            "memory_stats_after_forward": during,
            "memory_stats_after_backward": cell_memory_stats(pipe),
        }

    return step


def measure_pipe_peak(
    module: nn.Sequential,
    x: torch.Tensor,
    cells: int,
    chunks: int,
    checkpoint: str,
    device: torch.device,
    **options: Any,
) -> dict[str, Any]:
    """One warm-up step (worker threads, lazy state), then the peak of one measured step."""
    pipe = make_pipe(module, cells, chunks, checkpoint, device, **options)
    try:
        step = _pipe_step(pipe, x)
        step()
        return peak_of(step, device)
    finally:
        pipe.close()


def run_memory(ctx: Context) -> SectionOutput:
    cfg, device = ctx.scale.memory, ctx.device
    module = build_stack(cfg.blocks, cfg.width, device)
    x = torch.randn(cfg.batch, cfg.width, device=device)

    def plain_step() -> None:
        module(x).sum().backward()

    plain_step()  # gradients exist from here on: part of the fixed weights_and_grads
    activation = activation_bytes_per_sample_per_layer(module, x, device)
    model = MemoryModel(
        weights_and_grads_bytes=2 * parameter_bytes(module),
        boundary_bytes_per_sample=cfg.width * x.element_size(),
        activation_bytes_per_sample_per_layer=activation if activation is not None else math.nan,
        layers=cfg.blocks,
        batch=cfg.batch,
    )
    configs = [("plain", 1)] + [(mode, cells) for cells in cfg.cells for mode in CHECKPOINT_MODES]
    measured: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in configs}
    deadline = time.monotonic() + cfg.time_box_s
    for repeat in range(cfg.repeats):
        for mode, cells in rotated(configs, repeat):
            if measured[(mode, cells)] and time.monotonic() > deadline:
                continue  # time box: keep one measurement of every configuration
            if mode == "plain":
                result = peak_of(plain_step, device)
            else:
                result = measure_pipe_peak(module, x, cells, cfg.chunks, mode, device)
            measured[(mode, cells)].append(result)
            print(
                f"  {mode} K={cells}: peak allocated {fmt_mib(result['peak_allocated'])} MiB",
                flush=True,
            )

    rows, entries = [], []
    for mode, cells in configs:
        runs = measured[(mode, cells)]
        peaks = [r["peak_allocated"] for r in runs if r["peak_allocated"] is not None]
        reserved = [r["peak_reserved"] for r in runs if r["peak_reserved"] is not None]
        peak = max(peaks) if peaks else None
        paper = estimate_bytes(model, mode, cells, cfg.chunks)
        one_gpu = estimate_bytes(model, mode, cells, cfg.chunks, rebuilding_cells=cells)
        stash = None
        stats = runs[0].get("memory_stats_after_forward") if runs else None
        if stats:
            stash = sum(cell["stash_bytes"] for cell in stats)
        entry = {
            "mode": mode,
            "cells": cells,
            "chunks": cfg.chunks if mode != "plain" else 1,
            "runs": runs,
            "peak_allocated": peak,
            "peak_reserved": max(reserved) if reserved else None,
            "estimate_paper": paper,
            "estimate_one_gpu": one_gpu,
            "measured_vs_paper": ratio(peak, paper),
            "measured_vs_one_gpu": ratio(peak, one_gpu),
            "stash_bytes_after_forward": stash,
        }
        entries.append(entry)
        rows.append(
            (
                mode,
                cells if mode != "plain" else "-",
                fmt_mib(entry["peak_allocated"]),
                fmt_mib(entry["peak_reserved"]),
                fmt_mib(paper),
                fmt(entry["measured_vs_paper"], 2),
                fmt_mib(one_gpu),
                fmt(entry["measured_vs_one_gpu"], 2),
                fmt_mib(stash),
            )
        )
    table = markdown_table(
        (
            "mode",
            "K",
            "peak allocated MiB",
            "peak reserved MiB",
            "estimate (paper) MiB",
            "measured / paper",
            "estimate (K cells rebuilding) MiB",
            "measured / that",
            "stash after forward MiB",
        ),
        rows,
    )
    table += (
        f"\n\n{cfg.blocks} x MLPBlock({cfg.width}), batch N={cfg.batch}, M={cfg.chunks}, all cells "
        f"on {device}; weights+grads {fmt_mib(model.weights_and_grads_bytes)} MiB, activations "
        f"{fmt(None if activation is None else activation / 1024, 2)} KiB per sample per layer "
        "(measured on the plain model), boundary "
        f"{model.boundary_bytes_per_sample:.0f} B per sample"
    )
    data = {"config": cfg, "memory_model": model, "results": entries}
    return SectionOutput(data, table)


# -- section 5: largest model that trains one step ---------------------------------------------


@dataclass
class Trial:
    depth: int
    fits: bool
    seconds: float
    peak_allocated: int | None
    error: str | None


def make_optimizer(name: str, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    # foreach=False: the per-parameter loop, so no multi-tensor temporaries add to the peak.
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=False)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=False)
    raise ValueError(f"unknown optimizer {name!r}")


def try_one_step(
    build: Callable[[], nn.Sequential],
    cells: int,
    chunks: int,
    batch: int,
    width: int,
    optimizer: str,
    device: torch.device,
) -> tuple[bool, str | None]:
    """Builds the model (the plain module when cells == 0, else a GPipe with `cells` cells on
    `device`, checkpoint "always"), trains it one step and frees everything. Returns whether it
    fit, and the allocation error when it did not; any other error propagates."""
    module: nn.Sequential | None = None
    pipe: gf.GPipe | None = None
    optim: torch.optim.Optimizer | None = None
    x: torch.Tensor | None = None
    try:
        module = build()
        net: nn.Module = module
        if cells:
            pipe = make_pipe(module, cells, chunks, "always", device)
            net = pipe
        optim = make_optimizer(optimizer, module.parameters())
        x = torch.randn(batch, width, device=device)
        net(x).sum().backward()
        optim.step()
        synchronize(device)
        return True, None
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        return False, str(error).splitlines()[0][:300]
    finally:
        if pipe is not None:
            pipe.close()
        # Dropped here, not when the frame goes: an error's traceback keeps this frame alive.
        module = pipe = optim = x = net = None
        release_memory(device)


def run_largest(ctx: Context) -> SectionOutput:
    cfg, device = ctx.scale.largest, ctx.device
    fraction = ctx.memory_fraction
    on_cuda = device.type == "cuda"
    budget = None
    if on_cuda:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        budget = int(fraction * torch.cuda.get_device_properties(device).total_memory)
    per_block = params_per_block(cfg.width)
    contenders = [("plain", 0)] + [
        (f"gpipe K={cells} M={cfg.chunks} always", cells) for cells in cfg.cells
    ]
    searches: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    section_end = time.monotonic() + cfg.time_box_s
    plain_largest = 0
    try:
        for position, (label, cells) in enumerate(contenders):
            remaining = len(contenders) - position
            deadline = time.monotonic() + max(0.0, section_end - time.monotonic()) / remaining
            trials: list[Trial] = []

            def fits(
                depth: int, cells: int = cells, label: str = label, trials: list[Trial] = trials
            ) -> bool:
                start = time.perf_counter()
                if on_cuda:
                    release_memory(device)
                    torch.cuda.reset_peak_memory_stats(device)
                ok, error = try_one_step(
                    lambda: build_stack(depth, cfg.width, device),
                    cells,
                    cfg.chunks,
                    cfg.batch,
                    cfg.width,
                    cfg.optimizer,
                    device,
                )
                peak = torch.cuda.max_memory_allocated(device) if on_cuda else None
                trials.append(Trial(depth, ok, time.perf_counter() - start, peak, error))
                print(
                    f"  {label}: depth {depth} {'fits' if ok else 'out of memory'} "
                    f"({trials[-1].seconds:.1f} s, peak {fmt_mib(peak)} MiB)",
                    flush=True,
                )
                return ok

            # The pipes start from the plain module's limit: they should pass it at once.
            start = plain_largest if cells and plain_largest else cfg.start_depth
            entry: dict[str, Any] = {"cells": cells, "trials": trials}
            try:
                search = largest_passing(
                    fits,
                    start=start,
                    minimum=max(1, cells),
                    maximum=cfg.max_depth,
                    resolution=cfg.resolution,
                    deadline=deadline,
                )
            except Exception as error:  # not an allocation failure: a bug to report
                errors[label] = f"{type(error).__name__}: {error}"
                print(f"  {label} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
                search = SearchResult(0, None, [], "error")
            if cells == 0:
                plain_largest = search.largest
            entry.update(
                largest_depth=search.largest,
                smallest_failing_depth=search.smallest_failing,
                stopped=search.stopped,
                params=search.largest * per_block,
                error=errors.get(label),
            )
            searches[label] = entry
    finally:
        if on_cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, device)

    plain_params = searches["plain"]["params"]
    rows = []
    for label, entry in searches.items():
        entry["params_vs_plain"] = ratio(entry["params"], plain_params)
        if entry["cells"]:
            entry["verdict"] = verdict(entry["params_vs_plain"], CAPACITY_TARGET, at_most=False)
        fitting = [
            t.peak_allocated
            for t in entry["trials"]
            if t.fits and t.depth == entry["largest_depth"]
        ]
        rows.append(
            (
                label,
                entry["largest_depth"],
                entry["smallest_failing_depth"] if entry["smallest_failing_depth"] else "-",
                f"{entry['params'] / 1e6:.1f}M",
                fmt(entry["params_vs_plain"], 2),
                fmt_mib(fitting[0] if fitting and fitting[0] is not None else None),
                entry["stopped"],
                len(entry["trials"]),
            )
        )
    table = markdown_table(
        (
            "model",
            "largest depth",
            "first failing depth",
            "parameters",
            "vs plain",
            "peak allocated MiB at largest",
            "search",
            "trials",
        ),
        rows,
    )
    budget_text = (
        f"{fraction} of {device}'s memory ({fmt_mib(budget)} MiB, "
        "torch.cuda.set_per_process_memory_fraction)"
        if budget
        else "no limit (CPU smoke run)"
    )
    optimizer = "SGD, momentum 0.9" if cfg.optimizer == "sgd" else "Adam"
    table += (
        f"\n\nbudget: {budget_text}; depth x MLPBlock({cfg.width}) "
        f"({per_block} parameters per block), batch {cfg.batch}; one step = forward, "
        f"sum().backward(), {optimizer} step (foreach=False); target: the pipes' parameters "
        f">= {CAPACITY_TARGET}x the plain module's"
    )
    if errors:
        table += "\n\nFAILED: " + "; ".join(f"{n}: {why}" for n, why in errors.items())
    data = {
        "config": cfg,
        "memory_fraction": fraction,
        "budget_bytes": budget,
        "params_per_block": per_block,
        "optimizer": optimizer,
        "searches": searches,
    }
    return SectionOutput(data, table, "error" if errors else "ok")


# -- section 6: recompute pool on vs off -------------------------------------------------------


def run_pool(ctx: Context) -> SectionOutput:
    cfg, device = ctx.scale.memory, ctx.device
    if not supports_recompute_pool():
        reason = "this build's GPipe has no recompute_pool option"
        return SectionOutput({"reason": reason}, f"not measured: {reason}", status="unavailable")
    module = build_stack(cfg.blocks, cfg.width, device)
    x = torch.randn(cfg.batch, cfg.width, device=device)
    module(x).sum().backward()  # gradients allocated once, outside the measured steps
    configs = [
        (cells, mode, pool)
        for cells in cfg.cells
        for mode in CHECKPOINT_MODES
        for pool in (False, True)
    ]
    measured: dict[tuple[int, str, bool], list[dict[str, Any]]] = {key: [] for key in configs}
    deadline = time.monotonic() + ctx.scale.pool_time_box_s
    for repeat in range(cfg.repeats):
        for cells, mode, pool in rotated(configs, repeat):
            if measured[(cells, mode, pool)] and time.monotonic() > deadline:
                continue
            options = {"recompute_pool": True} if pool else {}
            try:
                result = measure_pipe_peak(module, x, cells, cfg.chunks, mode, device, **options)
            except (TypeError, ValueError, RuntimeError) as error:
                if device.type == "cuda" or not pool:
                    raise
                # A CPU smoke run: the pool is for CUDA cells, a build may refuse it on CPU.
                reason = f"recompute_pool=True on {device}: {type(error).__name__}: {error}"
                return SectionOutput({"reason": reason}, f"not measured: {reason}", "unavailable")
            measured[(cells, mode, pool)].append(result)
            print(
                f"  K={cells} {mode} pool={'on' if pool else 'off'}: peak reserved "
                f"{fmt_mib(result['peak_reserved'])} MiB",
                flush=True,
            )
    rows, entries = [], []
    for cells, mode, pool in configs:
        runs = measured[(cells, mode, pool)]
        allocated = [r["peak_allocated"] for r in runs if r["peak_allocated"] is not None]
        reserved = [r["peak_reserved"] for r in runs if r["peak_reserved"] is not None]
        peak_allocated = max(allocated) if allocated else None
        peak_reserved = max(reserved) if reserved else None
        fragmentation = (
            peak_reserved - peak_allocated
            if peak_reserved is not None and peak_allocated is not None
            else None
        )
        used = [r["device_used_after"] for r in runs if r.get("device_used_after") is not None]
        stats = runs[-1].get("memory_stats_after_backward") if runs else None
        rebuilt = [
            c["recompute_peak_bytes"]
            for c in stats or []
            if c.get("recompute_peak_bytes") is not None
        ]
        entry = {
            "cells": cells,
            "mode": mode,
            "recompute_pool": pool,
            "runs": runs,
            "peak_allocated": peak_allocated,
            "peak_reserved": peak_reserved,
            "reserved_minus_allocated": fragmentation,
            "device_used_after_step": max(used) if used else None,
            "recompute_peak_bytes_max_cell": max(rebuilt) if rebuilt else None,
        }
        entries.append(entry)
        rows.append(
            (
                cells,
                mode,
                "on" if pool else "off",
                fmt_mib(peak_allocated),
                fmt_mib(peak_reserved),
                fmt_mib(fragmentation),
                fmt_mib(entry["device_used_after_step"]),
                fmt_mib(entry["recompute_peak_bytes_max_cell"]),
            )
        )
    table = markdown_table(
        (
            "K",
            "checkpoint",
            "recompute pool",
            "peak allocated MiB",
            "peak reserved MiB",
            "reserved - allocated MiB",
            "device used after step MiB",
            "recompute_peak_bytes (max cell) MiB",
        ),
        rows,
    )
    table += (
        f"\n\nsame model as the memory section: {cfg.blocks} x MLPBlock({cfg.width}), batch "
        f"{cfg.batch}, M={cfg.chunks}; reserved - allocated uses torch's two peaks, which may "
        "fall at different moments of the step; device used = cudaMemGetInfo's total - free "
        "after the step (the CUDA context, torch's cache and any native pool arenas)"
    )
    return SectionOutput({"config": cfg, "results": entries}, table)


RUNNERS: dict[str, Callable[[Context], SectionOutput]] = {
    "overhead": run_overhead,
    "copies": run_copies,
    "memory": run_memory,
    "largest": run_largest,
    "pool": run_pool,
}


# -- command line -------------------------------------------------------------------------------


def parse_sections(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {unknown}; pick from {', '.join(SECTIONS)}"
        )
    return [name for name in SECTIONS if name in names]  # always in the documented order


def parse_fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a memory fraction is in (0, 1], got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="Sections: overhead (K=1 step vs the plain module), copies (boundary copy "
        "bandwidth: native copier vs cupy vs torch), memory (peak per checkpoint mode vs the "
        "paper's estimate), largest (deepest model that trains one step), pool (recompute pool "
        "on vs off). See bench/README.md.",
    )
    parser.add_argument(
        "--sections",
        type=parse_sections,
        default=list(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a much smaller sweep (time budget 180 s instead of 300 s)",
    )
    parser.add_argument(
        "--out", type=Path, help="JSON record (default: bench/results/gpu_cuda_path-<date>.json)"
    )
    parser.add_argument(
        "--memory-fraction",
        type=parse_fraction,
        help="share of the GPU's memory the largest-model search may use "
        "(default 0.25; 0.05 with --quick)",
    )
    parser.add_argument("--device", default="cuda:0", help="the GPU to measure (default cuda:0)")
    parser.add_argument(
        "--watchdog-s",
        type=float,
        default=540.0,
        help="past this many seconds, dump every thread's stack and exit: a hang then shows "
        "where it is before an outer time limit kills the run silently (0: off; default 540)",
    )
    parser.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="run every section's code at toy sizes on the CPU (for tests; measures nothing)",
    )
    return parser.parse_args(argv)


def resolve_device(args: argparse.Namespace) -> torch.device | str:
    """The device to measure, or why there is none."""
    if args.smoke_cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        return (
            "no CUDA GPU is visible to torch (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}): this script measures the CUDA "
            "path and needs a GPU (--smoke-cpu runs its code at toy sizes on the CPU)"
        )
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        return f"--device {args.device!r} is not a device: {error}"
    if device.type != "cuda":
        return f"--device must be a CUDA device, got {device}"
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        return f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible"
    if not _C.cuda_compiled():
        return (
            "gpipe_fast._C was built without CUDA (no nvcc when it was built): rebuild with the "
            "CUDA toolkit on PATH, e.g. pip install --no-build-isolation -e ."
        )
    return torch.device("cuda", index)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args)
    if isinstance(device, str):
        print(f"gpu_cuda_path.py: {device}", file=sys.stderr)
        return EXIT_NO_GPU
    scale = SCALES["smoke" if args.smoke_cpu else "quick" if args.quick else "full"]
    fraction = args.memory_fraction or scale.largest.memory_fraction
    out = args.out or default_out_path(dt.date.today())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # TF32 matrix products: the tensor cores' speed for float32 models, as training uses.
        torch.set_float32_matmul_precision("high")
    ctx = Context(device=device, scale=scale, memory_fraction=fraction)
    if args.watchdog_s > 0 and not args.smoke_cpu:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    try:
        return _run_sections(args, ctx, out, list(sys.argv[1:] if argv is None else argv))
    finally:
        faulthandler.cancel_dump_traceback_later()


def _run_sections(args: argparse.Namespace, ctx: Context, out: Path, argv: list[str]) -> int:
    """Runs the chosen sections in order, writing the record after each; 1 if any failed."""
    device, scale, fraction = ctx.device, ctx.scale, ctx.memory_fraction

    record: dict[str, Any] = {
        "script": "bench/gpu_cuda_path.py",
        "argv": argv,
        "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "scale": scale.name,
        "memory_fraction": fraction,
        "time_budget_s": scale.time_budget_s,
        "watchdog_s": args.watchdog_s,
        "sections_requested": args.sections,
        "environment": environment(device),
        "sections": {},
        "tables": {},
    }
    env_table = environment_table(record["environment"])
    record["tables"]["environment"] = env_table
    print(f"# gpu_cuda_path ({scale.name}) on {device}\n\n{env_table}\n", flush=True)
    write_json(out, record)

    failed = False
    budget_end = ctx.started + scale.time_budget_s
    for name in args.sections:
        if time.monotonic() > budget_end:
            record["sections"][name] = {"status": "skipped", "reason": "time budget spent"}
            print(f"## {name}: skipped (time budget of {scale.time_budget_s:.0f} s spent)\n")
            write_json(out, record)
            continue
        print(f"## {name}", flush=True)
        started = time.monotonic()
        try:
            output = RUNNERS[name](ctx)
            failed = failed or output.status == "error"
            entry: dict[str, Any] = {"status": output.status, **output.data}
            record["tables"][name] = output.table
            print(f"\n{output.table}\n", flush=True)
        except Exception as error:
            failed = True
            entry = {
                "status": "error",
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc(),
            }
            print(
                f"\nsection {name} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True
            )
        finally:
            release_memory(device)
        entry["seconds"] = time.monotonic() - started
        record["sections"][name] = entry
        write_json(out, record)
    record["total_seconds"] = time.monotonic() - ctx.started
    write_json(out, record)
    print(f"recorded: {out} ({record['total_seconds']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

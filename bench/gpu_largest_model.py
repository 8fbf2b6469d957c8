"""The largest model that trains one step on one GPU within a memory budget: the plain module
against gf.GPipe with checkpoint "always", by a doubling-then-bisecting search on its depth."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import gpu_harness as harness
import torch
from gpu_workload import build_stack, make_pipe, params_per_block
from reporting import fmt, fmt_mib, markdown_table, ratio, verdict
from torch import nn

import gpipe_fast as gf

NAME = "largest_model"
TARGET = 4.0  # parameters of the largest GPipe model / those of the plain module
# Messages of allocation failures that do not arrive as torch.cuda.OutOfMemoryError (cuBLAS
# workspaces, raw cudaMalloc in a native pool).
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


@dataclass(frozen=True)
class Config:
    width: int
    batch: int
    chunks: int
    cells: tuple[int, ...]
    start_depth: int
    max_depth: int
    resolution: float
    optimizer: str
    memory_fraction: float  # of the GPU's memory, through set_per_process_memory_fraction
    time_box_s: float


SCALES = {
    "full": Config(
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
    "quick": Config(
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
    # CPU only, for tests: the search at toy sizes, with no memory limit (every depth fits).
    "smoke": Config(
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
}


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
        harness.synchronize(device)
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
        harness.release_memory(device)


def measure(device: torch.device, cfg: Config) -> harness.Section:
    fraction = cfg.memory_fraction
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
                    harness.release_memory(device)
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
            entry["verdict"] = verdict(entry["params_vs_plain"], TARGET, at_most=False)
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
        f">= {TARGET}x the plain module's"
    )
    if errors:
        table += "\n\nFAILED: " + "; ".join(f"{n}: {why}" for n, why in errors.items())
    data = {
        "memory_fraction": fraction,
        "budget_bytes": budget,
        "params_per_block": per_block,
        "optimizer": optimizer,
        "searches": searches,
    }
    return harness.Section(data, table, "error" if errors else "ok")


def parse_fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a memory fraction is in (0, 1], got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory-fraction",
        type=parse_fraction,
        help="share of the GPU's memory the largest-model search may use "
        "(default 0.25; 0.05 with --quick)",
    )


def measurement(args: argparse.Namespace) -> harness.Measurement:
    cfg = SCALES[harness.scale(args)]
    if args.memory_fraction is not None:
        cfg = replace(cfg, memory_fraction=args.memory_fraction)
    return harness.Measurement(NAME, lambda device: measure(device, cfg), cfg)


def main(argv: Sequence[str] | None = None) -> int:
    return harness.main(__file__, __doc__, measurement, argv, add_arguments)


if __name__ == "__main__":
    sys.exit(main())

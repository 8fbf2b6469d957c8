"""What every GPU measurement script shares: its command line, the device it measures (or why
there is none: exit 2), sections recorded one by one, and synchronised timing and peaks."""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from reporting import Record, default_out_path, environment, environment_table, watchdog

from gpipe_fast import _C

EXIT_NO_GPU = 2
WATCHDOG_S = 540.0  # under the 600 s a GPU session's command may run


@dataclass
class Section:
    """One measurement's result: its record entry and its markdown table."""

    data: dict[str, Any]
    table: str
    # "ok"; "unavailable": what it measures is missing from this build; "error": a contender
    # failed (the others' results are kept).
    status: str = "ok"


@dataclass(frozen=True)
class Measurement:
    name: str
    measure: Callable[[torch.device], Section]
    # Recorded with the section: the sizes and limits it ran with.
    config: Any = field(default=None)


# -- command line -------------------------------------------------------------------------------


def parser(description: str | None, script: str) -> argparse.ArgumentParser:
    """The options every GPU script takes; a script adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true", help="a much smaller sweep (a few minutes in all)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=f"JSON record (default: bench/results/{Path(script).stem}-<date>.json)",
    )
    parser.add_argument("--device", default="cuda:0", help="the GPU to measure (default cuda:0)")
    parser.add_argument(
        "--watchdog-s",
        type=float,
        default=WATCHDOG_S,
        help="past this many seconds, dump every thread's stack and exit: a hang then shows "
        f"where it is before an outer time limit kills the run silently (0: off; default "
        f"{WATCHDOG_S:.0f})",
    )
    parser.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="run the code at toy sizes on the CPU (for tests; measures nothing)",
    )
    return parser


def scale(args: argparse.Namespace) -> str:
    """Which of a script's SCALES to run: "smoke", "quick" or "full"."""
    return "smoke" if args.smoke_cpu else "quick" if args.quick else "full"


def scaled(
    name: str,
    scales: Mapping[str, Any],
    measure: Callable[[torch.device, Any], Section],
    args: argparse.Namespace,
) -> Measurement:
    """The measurement `name`: `measure` at the one of its `scales` the command line asks for."""
    config = scales[scale(args)]
    return Measurement(name, lambda device: measure(device, config), config)


def main(
    script_file: str,
    description: str | None,
    measurement: Callable[[argparse.Namespace], Measurement],
    argv: Sequence[str] | None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """A script run alone: the common options (and its own), then its one measurement."""
    script = Path(script_file).name
    options = parser(description, script)
    if add_arguments is not None:
        add_arguments(options)
    args = options.parse_args(argv)
    return run(script, [measurement(args)], args, argv)


def scaled_script(
    script_file: str,
    description: str | None,
    name: str,
    scales: Mapping[str, Any],
    measure: Callable[[torch.device, Any], Section],
) -> tuple[Callable[[argparse.Namespace], Measurement], Callable[[Sequence[str] | None], int]]:
    """A script's measurement (`measure` at the scale asked for, see scaled) and its main,
    for a script with no options of its own."""

    def measurement(args: argparse.Namespace) -> Measurement:
        return scaled(name, scales, measure, args)

    def script_main(argv: Sequence[str] | None = None) -> int:
        return main(script_file, description, measurement, argv)

    return measurement, script_main


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
            "gpipe_fast._C was built without CUDA (no nvcc, or a CPU-only torch, when it was "
            "built): rebuild with the CUDA toolkit on PATH and a CUDA torch, e.g. "
            "pip install --no-build-isolation -e . (GPIPE_FAST_CUDA=ON forces it)"
        )
    return torch.device("cuda", index)


def run(
    script: str,
    measurements: Sequence[Measurement],
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    *,
    budget_s: float | None = None,
) -> int:
    """Runs `measurements` in order on the chosen device, printing each table and rewriting
    the JSON record after each. None starts after `budget_s`. Returns 0, 1 if any failed, or
    EXIT_NO_GPU (with the reason on stderr) when there is no device to measure."""
    started = time.monotonic()
    device = resolve_device(args)
    if isinstance(device, str):
        print(f"{script}: {device}", file=sys.stderr)
        return EXIT_NO_GPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # TF32 matrix products: the tensor cores' speed for float32 models, as training uses.
        torch.set_float32_matmul_precision("high")
    out = args.out or default_out_path(Path(script).stem)
    with watchdog(0 if args.smoke_cpu else args.watchdog_s):
        record = Record(
            out,
            script=f"bench/{script}",
            argv=list(sys.argv[1:] if argv is None else argv),
            started_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            scale=scale(args),
            time_budget_s=budget_s,
            watchdog_s=args.watchdog_s,
            sections_requested=[m.name for m in measurements],
            environment=environment(device),
        )
        env_table = environment_table(record.data["environment"])
        record.data["tables"]["environment"] = env_table
        print(f"# {Path(script).stem} ({scale(args)}) on {device}\n\n{env_table}\n", flush=True)
        failed = False
        for measurement in measurements:
            if budget_s is not None and time.monotonic() - started > budget_s:
                record.add(measurement.name, {"status": "skipped", "reason": "time budget spent"})
                print(f"## {measurement.name}: skipped (time budget of {budget_s:.0f} s spent)\n")
                continue
            entry, table = _run_one(measurement, device)
            failed = failed or entry["status"] == "error"
            record.add(measurement.name, entry, table)
        record.data["total_seconds"] = time.monotonic() - started
        record.save()
    print(f"recorded: {out} ({record.data['total_seconds']:.0f} s)")
    return 1 if failed else 0


def _run_one(measurement: Measurement, device: torch.device) -> tuple[dict[str, Any], str | None]:
    print(f"## {measurement.name}", flush=True)
    started = time.monotonic()
    table = None
    try:
        section = measurement.measure(device)
        entry: dict[str, Any] = {"status": section.status, "config": measurement.config}
        entry.update(section.data)
        table = section.table
        print(f"\n{table}\n", flush=True)
    except Exception as error:
        entry = {
            "status": "error",
            "config": measurement.config,
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(),
        }
        print(
            f"\n{measurement.name} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True
        )
    finally:
        release_memory(device)
    entry["seconds"] = time.monotonic() - started
    return entry, table


# -- measuring ----------------------------------------------------------------------------------


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


def peak_of(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Runs `step` once from a clean allocator and returns its peak memory (None on CPU),
    updated with what `step` returns when that is a dict."""
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


def _device_used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """`items` rotated left by `shift`: each round starts with a different contender."""
    if not items:
        return []
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


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

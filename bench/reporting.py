"""What the benchmarks report: medians and ratios, markdown tables, JSON records rewritten
after each section, the environment they ran in, a watchdog for hangs, and the outputs of
workers spawned one per rank."""

from __future__ import annotations

import datetime as dt
import faulthandler
import inspect
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch

import gpipe_fast as gf
from gpipe_fast import _C

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
MIB = 2**20


# -- numbers ------------------------------------------------------------------------------------


def is_number(value: float | None) -> bool:
    return value is not None and not math.isnan(value) and not math.isinf(value)


def median(values: Sequence[float]) -> float:
    """Median, NaN for no values."""
    return statistics.median(values) if values else math.nan


def ratio(numerator: float | None, denominator: float | None) -> float:
    """numerator / denominator, NaN when either is missing or the denominator is 0."""
    if not (is_number(numerator) and is_number(denominator)) or denominator == 0:
        return math.nan
    return numerator / denominator  # type: ignore[operator]


def paired_ratio(samples: Sequence[float], reference: Sequence[float]) -> float:
    """Median over rounds of sample / reference within the same round (rounds aligned): the
    machine's drift between rounds cancels, which a ratio of medians does not do."""
    if len(samples) != len(reference):
        raise ValueError(f"{len(samples)} samples against {len(reference)} reference samples")
    return median([ratio(s, r) for s, r in zip(samples, reference, strict=True)])


def verdict(value: float, target: float, *, at_most: bool) -> str:
    """ "met" or "NOT met" against a target, "not measured" without a value."""
    if not is_number(value):
        return "not measured"
    met = value <= target if at_most else value >= target
    return "met" if met else "NOT met"


# -- text ---------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if is_number(value) else "n/a"


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


# -- records ------------------------------------------------------------------------------------


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
        return value if is_number(value) else None
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    return str(value)


def write_json(path: Path, record: Mapping[str, Any]) -> None:
    """Writes `record` to `path` through a temporary file, so a run killed mid-write keeps the
    previous complete record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(jsonable(record), indent=2, allow_nan=False) + "\n")
    os.replace(partial, path)


def default_out_path(name: str, today: dt.date | None = None) -> Path:
    """bench/results/<name>-<date>.json"""
    return RESULTS / f"{name}-{(today or dt.date.today()).isoformat()}.json"


class Record:
    """One run's JSON record, rewritten after each section: a run cut short keeps what
    finished."""

    def __init__(self, path: Path, **header: Any) -> None:
        self.path = path
        self.data: dict[str, Any] = {**header, "sections": {}, "tables": {}}
        self.save()

    def add(self, name: str, entry: Mapping[str, Any], table: str | None = None) -> None:
        self.data["sections"][name] = dict(entry)
        if table is not None:
            self.data["tables"][name] = table
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)


# -- environment --------------------------------------------------------------------------------


def _run_quietly(command: Sequence[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit() -> dict[str, Any] | None:
    """The checkout's commit and whether tracked files differ from it (None without .git)."""
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
    return smi.splitlines()[0].strip() if smi else None


def environment(device: torch.device) -> dict[str, Any]:
    """Software, build and GPUs of this run."""
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
            "recompute_pool_option": "recompute_pool"
            in inspect.signature(gf.GPipe.__init__).parameters,
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


# -- watchdog -----------------------------------------------------------------------------------


@contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Past `seconds`, dumps every thread's stack to stderr and exits the process: a hang then
    shows where it is before an outer time limit kills the run silently (0: off)."""
    if seconds <= 0:
        yield
        return
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def spawned_ranks(worker: Callable[..., None], world: int, extra: tuple[Any, ...],
                  timeout_s: float, prefix: str) -> list[Any]:  # fmt: skip
    """`worker(rank, world, folder, *extra)` on `world` spawned processes, each saving its
    output to `folder`/rank<r>.pt; their outputs by rank. A rank still running after
    `timeout_s` is killed, and any exit code but 0 is a RuntimeError."""
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        context = mp.get_context("spawn")
        processes = [context.Process(target=worker, args=(rank, world, folder, *extra),
                                     daemon=True) for rank in range(world)]  # fmt: skip
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        for process in processes:
            process.join(max(1.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        codes = [process.exitcode for process in processes]
        if any(code != 0 for code in codes):
            raise RuntimeError(f"the {world} workers exited with {codes} (timeout {timeout_s} s)")
        return [torch.load(Path(folder) / f"rank{rank}.pt") for rank in range(world)]

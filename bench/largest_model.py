"""The GPipe paper's Table 1 on CPU: the largest model that trains under a per-rank memory cap."""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gpipe_fast as gf

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20

# The model family: a residual MLP of fixed width, grown by depth (see Block). The batch is
# per replica, so a dp=2 row trains twice the samples and only the sharding changes what a
# rank holds. A block keeps 5 * BATCH * WIDTH floats for its backward (the ReLU's output and
# its own): 640 KiB, a little more than its parameters' training state (16 bytes per
# parameter with AdamW: weights, gradients, two moments, 517 KiB), so that both matter.
WIDTH = 64
BATCH = 512
CHUNKS = 4
STEPS = 3  # the first creates AdamW's state; the step time is the median of the others
# Address space above the calibrated interpreter (see calibrate), per rank.
BUDGET_MIB = {"full": 128, "quick": 48}
# A search settles within 1 block per stage or 1/RESOLUTION of what fits. The quick table (a
# test's) settles coarser: each bisection step past a failure is a fresh world of processes
# (seconds), and the test reads the table's shape, not its last blocks.
RESOLUTION = {"full": 16, "quick": 4}
# A world ends once a trial's cleanup leaves its address space this far above the
# calibration's (a library that keeps threads or groups per pipe would shrink the budget of
# every later trial).
LEAK_SLACK = 16 * MIB
PIPE_TIMEOUT_S = 120.0  # every wait of a pipe on another rank
WORLD_TIMEOUT_S = 900.0  # one configuration's whole search
# One trial, or the calibration: a world silent for longer is ended, its trial counted as not
# fitting (a rank refused memory inside a collective that waits for its peers unbounded).
TRIAL_TIMEOUT_S = 300.0
# glibc settings read at process start: every tensor of 64 KiB or more is its own mapping,
# unmapped when freed, and at most 2 arenas, so that the resident set and the address
# space follow the live tensors (the peak of VmHWM matched live tensor bytes to 2-4%).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}
# How an allocation refused under RLIMIT_AS reads (torch's CPU allocator, Python, C++,
# a thread that could not map its stack).
OOM_MARKERS = (
    "can't allocate memory",
    "cannot allocate memory",
    "out of memory",
    "bad_alloc",
    "can't start new thread",
    "memoryerror",
)

# What a rank reports after a trial; the ranks agree on the largest (an all_reduce MAX).
FIT, PEER, OOM, ERROR = 0, 1, 2, 3
OUTCOMES = {FIT: "fit", PEER: "peer failed", OOM: "out of memory", ERROR: "error"}


@dataclass(frozen=True)
class Config:
    """One row of the table: pipeline stages, sharded data parallelism, re-materialisation."""

    pp: int
    dp_shard: bool
    checkpoint: str

    @property
    def dp(self) -> int:
        return 2 if self.dp_shard else 1

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def name(self) -> str:
        shard = "dp=2 sharded" if self.dp_shard else "dp off"
        return f"pp={self.pp}, {shard}, checkpoint={self.checkpoint}"


CONFIGS = [
    Config(pp, dp_shard, checkpoint)
    for pp in (1, 2, 4)
    for dp_shard in (False, True)
    for checkpoint in ("never", "always")
]
BASELINE = Config(1, False, "never")


def dp_shard_available() -> bool:
    """Whether this gpipe_fast shards a stage over its dp group (GPipe's dp_shard kwarg)."""
    return "dp_shard" in inspect.signature(gf.GPipe.__init__).parameters


# -- memory of this process ---------------------------------------------------------------------


def status_bytes(key: str) -> int:
    """A field of /proc/self/status (VmSize, VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Resets VmHWM to the current resident set (the kernel's peak-RSS mark)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def cap_address_space(limit: int) -> None:
    """Caps this process's address space (soft RLIMIT_AS): an allocation beyond it fails."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def uncap_address_space() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    text = f"{type(error).__name__}: {error}".lower()
    return any(marker in text for marker in OOM_MARKERS)


# -- the model ----------------------------------------------------------------------------------


class Block(nn.Module):
    """x + Linear(4d, d)(ReLU(Linear(d, 4d)(x))): a transformer's MLP without the attention,
    so parameters and activations both grow by a fixed amount per block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def build_model(depth: int, width: int = WIDTH) -> nn.Sequential:
    """`depth` blocks on the meta device: each rank's pipe gives memory to its own cells only."""
    with torch.device("meta"):
        return nn.Sequential(*(Block(width) for _ in range(depth)))


def parameters_of(depth: int, width: int = WIDTH) -> int:
    return depth * (8 * width * width + 5 * width)


def depth_of(config: Config, per_stage: int) -> int:
    return config.pp * per_stage


# -- the search ---------------------------------------------------------------------------------


class NoFit(Exception):
    """A trial did not fit: its world ends, and the search goes on in fresh processes."""


class Leaked(Exception):
    """A trial left address space behind: its world ends, and the search goes on in fresh
    processes (where the next trial has the whole budget)."""


def settled(lo: int, hi: int, resolution: int = RESOLUTION["full"]) -> bool:
    """Whether the bounds are close enough: 1 block per stage, or 1/resolution of what fits."""
    return hi - lo <= max(1, lo // resolution)


def search_largest(fits: Callable[[int], bool], lo: int = 0, hi: int | None = None,
                   resolution: int = RESOLUTION["full"]) -> int:  # fmt: skip
    """The largest n (to `settled`'s resolution) with fits(n), 0 if none: doubling from
    2 * lo (or 1) until a failure, then bisection; `lo` is known to fit (0: nothing known)
    and `hi` known not to (None: unknown). Assumes that anything smaller than a fit fits."""
    while hi is None:
        n = max(1, 2 * lo)
        if fits(n):
            lo = n
        else:
            hi = n
    while not settled(lo, hi, resolution):
        n = (lo + hi) // 2
        if fits(n):
            lo = n
        else:
            hi = n
    return lo


def next_bounds(
    trials: Sequence[dict[str, Any]], lo: int, hi: int | None
) -> tuple[int, int | None]:
    """The bounds after these trials: the largest fit, the smallest failure."""
    for trial in trials:
        if trial["outcome"] == "fit":
            lo = max(lo, trial["per_stage"])
        else:
            hi = trial["per_stage"] if hi is None else min(hi, trial["per_stage"])
    return lo, hi


# -- one rank -----------------------------------------------------------------------------------


@dataclass
class Groups:
    """This rank's pipeline and data-parallel groups for one trial (fresh each trial, so a
    failed step on the last trial's groups leaves nothing behind)."""

    pp: Any = None
    dp: Any = None
    made: list[Any] = field(default_factory=list)

    def destroy(self) -> None:
        import torch.distributed as dist

        for group in self.made:
            dist.destroy_process_group(group)
        self.made.clear()


def make_groups(config: Config, rank: int) -> Groups:
    """Rank r of a pp x dp mesh: replica r // pp, stage r % pp (as init_device_mesh's
    ("dp", "pp") lays them out). Every rank creates every group, in the same order."""
    import torch.distributed as dist

    groups = Groups()
    if config.world == 1:
        return groups
    timeout = timedelta(seconds=PIPE_TIMEOUT_S)
    if config.pp > 1:
        for replica in range(config.dp):
            ranks = [replica * config.pp + s for s in range(config.pp)]
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            groups.made.append(group)
            if rank in ranks:
                groups.pp = group
    if config.dp > 1:
        for stage in range(config.pp):
            ranks = [replica * config.pp + stage for replica in range(config.dp)]
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            groups.made.append(group)
            if rank in ranks:
                groups.dp = group
    return groups


def make_pipe(config: Config, depth: int, groups: Groups) -> gf.GPipe:
    """A pipe of `depth` blocks in `config.pp` even stages; with pp=1 and dp off, a K=1 pipe
    in this process (so every row runs the same micro-batches and re-materialisation)."""
    kwargs: dict[str, Any] = {}
    if config.dp_shard:
        kwargs = {
            "dp_shard": True,
            "dp_shard_sync": "per_microbatch",
            "reshard_after_forward": True,
        }
    return gf.GPipe(
        build_model(depth),
        balance=[depth // config.pp] * config.pp,
        chunks=CHUNKS,
        checkpoint=config.checkpoint,
        pp_group=groups.pp,
        dp_group=groups.dp,
        timeout=PIPE_TIMEOUT_S,
        **kwargs,
    )


def train_steps(pipe: gf.GPipe, steps: int, seed: int) -> list[float]:
    """`steps` training steps (MSE on a random target, AdamW); each step's seconds."""
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        x = torch.randn(BATCH, WIDTH, generator=generator)
        y = torch.randn(BATCH, WIDTH, generator=generator)
        start = time.perf_counter()
        pipe.train_step(x, y, nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def attempt(config: Config, per_stage: int, rank: int, steps: int = STEPS) -> dict[str, Any]:
    """One trial on this rank: build, train `steps` steps, free everything; what happened."""
    record: dict[str, Any] = {"rank": rank}
    reset_peak_rss()
    record["rss_before"] = status_bytes("VmRSS")
    groups, pipe = Groups(), None
    try:
        groups = make_groups(config, rank)
        pipe = make_pipe(config, depth_of(config, per_stage), groups)
        record["local_parameters"] = sum(p.numel() for p in pipe.parameters())
        record["step_s"] = train_steps(pipe, steps, seed=rank)
        record["outcome"] = FIT
    except Exception as error:  # an over-budget step, or another rank's (PeerFailure)
        record["error"] = f"{type(error).__name__}: {error}"[:500]
        if is_out_of_memory(error):
            record["outcome"] = OOM
        elif isinstance(error, gf.PeerFailure):
            record["outcome"] = PEER
        else:
            record["outcome"] = ERROR
    finally:
        record["peak_rss"] = status_bytes("VmHWM")
        record["vm_size"] = status_bytes("VmSize")
        if pipe is not None:
            pipe.close()
        del pipe
        gc.collect()
        groups.destroy()
    return record


def agree(outcome: int, world: int) -> int:
    """The worst outcome over every rank (an all_reduce, bounded by the group's timeout)."""
    if world == 1:
        return outcome
    import torch.distributed as dist

    flag = torch.tensor([outcome], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def gather(record: dict[str, Any], world: int) -> list[dict[str, Any]]:
    if world == 1:
        return [record]
    import torch.distributed as dist

    records: list[Any] = [None] * world
    dist.all_gather_object(records, record)
    return records


def calibrate(config: Config, rank: int) -> int:
    """This rank's address space with the interpreter, torch, gloo, a pipe of this
    configuration (its threads and rings) and two steps of a one-block-per-stage model: the
    base of its cap (the cap is base + budget)."""
    record = attempt(config, 1, rank, steps=2)
    if record["outcome"] != FIT:
        raise RuntimeError(f"calibration failed on rank {rank}: {record.get('error')}")
    return int(record["vm_size"])


class Events:
    """Rank 0's record of the search, one JSON line per event (the parent follows it)."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.rank = path, rank

    def write(self, **event: Any) -> None:
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(event) + "\n")


def rank_main(spec: dict[str, Any]) -> None:
    """One rank of one configuration's search: join, calibrate, cap, then trials until the
    search settles or a trial does not fit. A failed step leaves the allocator's heap
    fragmented (glibc keeps address space that later trials then lack), so each world ends
    at its first failure and the parent goes on in fresh processes."""
    import torch.distributed as dist

    config = Config(**spec["config"])
    rank, world, folder = spec["rank"], config.world, Path(spec["folder"])
    events = Events(folder / "events.jsonl", rank)
    torch.set_num_threads(1)
    if world > 1:
        store = dist.FileStore(str(folder / "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=PIPE_TIMEOUT_S))  # fmt: skip
    base = calibrate(config, rank)
    budget = spec["budget_mib"] * MIB
    events.write(event="calibrated", budget=budget,
                 ranks=gather({"vm_base": base, "rss": status_bytes("VmRSS")}, world))  # fmt: skip
    cap_address_space(base + budget)

    def fits(per_stage: int) -> bool:
        events.write(event="start", per_stage=per_stage)
        record = attempt(config, per_stage, rank)
        outcome = agree(record["outcome"], world)
        records = gather(record, world)
        events.write(event="trial", per_stage=per_stage, outcome=OUTCOMES[outcome], ranks=records)
        if outcome in (ERROR, PEER):  # PEER alone: a failure that no rank owns
            raise RuntimeError(f"the trial of {per_stage} blocks per stage failed: {records}")
        if outcome == OOM:
            raise NoFit
        if agree(int(status_bytes("VmSize") > base + LEAK_SLACK), world):
            raise Leaked
        return True

    try:
        if spec.get("trial"):  # one trial of that size (the tests' probe)
            events.write(event="done", per_stage=spec["trial"] if fits(spec["trial"]) else 0)
        else:
            found = search_largest(fits, spec["lo"], spec["hi"], spec["resolution"])
            events.write(event="done", per_stage=found)
    except (NoFit, Leaked):
        pass
    uncap_address_space()
    if world > 1:
        dist.destroy_process_group()


# -- the parent: worlds of processes per configuration --------------------------------------------


def worker_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, **MALLOC_ENV, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def launch(config: Config, folder: Path, **spec: Any) -> list[Any]:
    """The world's processes, each `python largest_model.py --worker SPEC` (fresh
    interpreters: glibc reads MALLOC_* at start)."""
    spec.update(config=asdict(config), folder=str(folder))
    processes = []
    for rank in range(config.world):
        with open(folder / f"rank{rank}.err", "w") as err:
            command = [sys.executable, __file__, "--worker", json.dumps({**spec, "rank": rank})]
            processes.append(subprocess.Popen(command, env=worker_env(),
                                              stdout=subprocess.DEVNULL, stderr=err))  # fmt: skip
    return processes


def follow(processes: list[Any], events: Path, timeout_s: float, progress: Any) -> list[int]:
    """Waits for the world to end (or `timeout_s`, or TRIAL_TIMEOUT_S without news),
    advancing `progress` per trial; a rank that failed ends the others (they would wait for
    it up to their timeouts)."""
    deadline, seen, events_seen, last_event = time.monotonic() + timeout_s, 0, 0, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - last_event < TRIAL_TIMEOUT_S:
        read = read_events(events)
        if len(read) > events_seen:
            events_seen, last_event = len(read), time.monotonic()
        trials = sum(e["event"] == "trial" for e in read)
        progress.update(trials - seen)
        seen = trials
        codes = [process.poll() for process in processes]
        if all(code == 0 for code in codes) or any(code not in (None, 0) for code in codes):
            break
        time.sleep(0.2)
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
    return [process.returncode for process in processes]


@dataclass
class World:
    """What one world of processes did: its events and exit codes, its ranks' stderr."""

    events: list[dict[str, Any]]
    codes: list[int]
    errors: list[str]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    def died_in(self) -> int | None:
        """The trial a rank died in (started, never agreed on), if any."""
        finished = {e["per_stage"] for e in self.of("trial")}
        started = [e["per_stage"] for e in self.of("start") if e["per_stage"] not in finished]
        return started[-1] if started else None


def run_world(
    config: Config,
    budget_mib: int,
    lo: int = 0,
    hi: int | None = None,
    *,
    trial: int | None = None,
    progress: Any = None,
    timeout_s: float = WORLD_TIMEOUT_S,
    resolution: int = RESOLUTION["full"],
) -> World:
    """The search of `config` from bounds (lo, hi) in one fresh world of processes, until
    it settles or a trial does not fit; or only the trial of `trial` blocks per stage."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    with tempfile.TemporaryDirectory(prefix="largest_model_") as name:
        folder = Path(name)
        processes = launch(config, folder, budget_mib=budget_mib, lo=lo, hi=hi, trial=trial,
                           resolution=resolution)  # fmt: skip
        bar = progress if progress is not None else tqdm(disable=True)
        codes = follow(processes, folder / "events.jsonl", timeout_s, bar)
        errors = [(folder / f"rank{r}.err").read_text()[-3000:] for r in range(config.world)]
        return World(read_events(folder / "events.jsonl"), codes, errors)


@dataclass
class Result:
    config: Config
    status: str  # "measured", "n/a (...)", "error: ..."
    per_stage: int = 0
    trials: list[dict[str, Any]] = field(default_factory=list)
    calibration: list[dict[str, Any]] = field(default_factory=list)
    worlds: int = 0

    @property
    def depth(self) -> int:
        return depth_of(self.config, self.per_stage)

    @property
    def parameters(self) -> int:
        return parameters_of(self.depth)

    def best_trial(self) -> dict[str, Any] | None:
        fitting = [t for t in self.trials if t["outcome"] == "fit"]
        return max(fitting, key=lambda t: t["per_stage"]) if fitting else None


def search_config(config: Config, budget_mib: int, progress: Any = None,
                  resolution: int = RESOLUTION["full"]) -> Result:  # fmt: skip
    """One configuration's search over fresh worlds: each runs trials from the bounds so far
    until one does not fit (a rank that dies in a trial: not fitting either, its step did
    not complete), and the next starts from the new bounds."""
    result = Result(config, "measured")
    lo, hi = 0, None
    while hi is None or not settled(lo, hi, resolution):
        world = run_world(config, budget_mib, lo, hi, progress=progress, resolution=resolution)
        result.worlds += 1
        result.calibration = result.calibration or [e["ranks"] for e in world.of("calibrated")]
        result.trials += world.of("trial")
        done = world.of("done")
        if done and world.codes == [0] * config.world:
            result.per_stage = done[0]["per_stage"]
            return result
        died = world.died_in()
        if world.codes != [0] * config.world and died is None:
            result.status = f"error: ranks exited with {world.codes}: {last_line(world.errors)}"
            return result
        if not world.of("trial") and died is None:
            result.status = f"error: a world ran no trial: {last_line(world.errors)}"
            return result
        if died is not None:
            result.trials.append(
                {"per_stage": died, "outcome": "rank died or hung", "codes": world.codes}
            )
        lo, hi = next_bounds(result.trials, lo, hi)
    result.per_stage = lo
    return result


def last_line(errors: Sequence[str]) -> str:
    lines = [line for text in errors for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


# -- the report ---------------------------------------------------------------------------------


def row(result: Result, baseline: Result | None) -> dict[str, Any]:
    """One row of the table as numbers (None where not measured)."""
    entry: dict[str, Any] = {"configuration": result.config.name, "status": result.status,
                             **asdict(result.config), "ranks": result.config.world}  # fmt: skip
    trial = result.best_trial()
    if result.status != "measured" or trial is None:
        return entry
    ranks = trial["ranks"]
    base = baseline.parameters if baseline and baseline.status == "measured" else 0
    entry.update(
        depth=result.depth,
        parameters=result.parameters,
        ratio=result.parameters / base if base else None,
        peak_rss_mib=max(r["peak_rss"] for r in ranks) / MIB,
        step_peak_mib=max(r["peak_rss"] - r["rss_before"] for r in ranks) / MIB,
        step_s=max(statistics.median(r["step_s"][1:]) for r in ranks),
        trials=len(result.trials),
    )
    return entry


def table(rows: Sequence[dict[str, Any]]) -> str:
    header = ("| configuration | ranks | blocks | parameters that fit | vs pp=1, dp off, never "
              "| per-rank peak RSS MiB (above start) | step s |")  # fmt: skip
    lines = [header, "|" + "---|" * 7]
    for r in rows:
        if "parameters" not in r:
            lines.append(f"| {r['configuration']} | {r['ranks']} | {r['status']} | | | | |")
            continue
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "n/a"
        lines.append(
            f"| {r['configuration']} | {r['ranks']} | {r['depth']} | {r['parameters'] / 1e6:.2f}M "
            f"| {ratio} | {r['peak_rss_mib']:.0f} ({r['step_peak_mib']:.0f}) | {r['step_s']:.2f} |"
        )
    return "\n".join(lines)


def run_table(
    configs: Sequence[Config],
    budget_mib: int,
    done: Callable[[list[Result]], None] | None = None,
    resolution: int = RESOLUTION["full"],
) -> list[Result]:
    """Every configuration's search in turn; `done(results so far)` after each."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    results: list[Result] = []
    available = dp_shard_available()
    with tqdm(desc="largest model", unit="trial", total=len(configs) * 12) as progress:
        for config in configs:
            progress.set_postfix_str(config.name)
            if config.dp_shard and not available:
                results.append(Result(config, "n/a (dp_shard not available)"))
            else:
                results.append(search_config(config, budget_mib, progress, resolution))
            if done is not None:
                done(results)
    return results


def rows_of(results: Sequence[Result]) -> list[dict[str, Any]]:
    baseline = next((r for r in results if r.config == BASELINE), None)
    return [row(result, baseline) for result in results]


def write_record(path: Path, budget_mib: int, results: Sequence[Result]) -> None:
    """The rows and every trial, rewritten after each configuration (a long run that is
    stopped keeps what it measured)."""
    record = {"width": WIDTH, "batch": BATCH, "chunks": CHUNKS, "steps": STEPS,
              "budget_mib": budget_mib, "dp_shard_available": dp_shard_available(),
              "rows": rows_of(results), "results": [asdict(r) for r in results]}  # fmt: skip
    path.write_text(json.dumps(record, indent=1, default=str))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="a smaller cap and a coarser search (for a test)")  # fmt: skip
    parser.add_argument("--budget-mib", type=int, help="address space per rank above the "
                        f"calibrated interpreter (default: {BUDGET_MIB['full']}, --quick: "
                        f"{BUDGET_MIB['quick']})")  # fmt: skip
    parser.add_argument("--only", action="append", default=[],
                        help="configurations whose name has this text (repeatable)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the rows and every trial here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        # A rank ends without the interpreter's teardown, once its events are written: after
        # an out-of-memory trial, collecting a gloo process group there could wait on a lock
        # forever (seen 4 times in 21 searches), and the world then timed out as an error.
        code = 0
        try:
            rank_main(json.loads(args.worker))
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    size = "quick" if args.quick else "full"
    budget = args.budget_mib or BUDGET_MIB[size]
    configs = [c for c in CONFIGS if not args.only or any(o in c.name for o in args.only)]
    started = time.perf_counter()
    json_path = args.json
    write = None if json_path is None else partial(write_record, json_path, budget)
    results = run_table(configs, budget, write, RESOLUTION[size])
    print(
        f"\nwidth {WIDTH}, batch {BATCH} per replica, {CHUNKS} micro-batches, AdamW, "
        f"{STEPS} steps per trial; cap per rank: its calibrated address space + {budget} MiB"
    )
    print(table(rows_of(results)))
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0 if all(not r.status.startswith("error") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

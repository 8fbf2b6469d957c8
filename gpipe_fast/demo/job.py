"""The demo job: a deep MLP trained through GPipe and as the plain model, side by side.

It says where the pipelined step's time went."""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm  # type: ignore[import-untyped]

import gpipe_fast as gf
from gpipe_fast.demo import alone as alone
from gpipe_fast.demo import processes
from gpipe_fast.demo import report as report
from gpipe_fast.demo.workload import Batch, cells_per_worker, workload
from gpipe_fast.device.host import cpu_cores
from gpipe_fast.planning.predict import StageCosts
from gpipe_fast.schedule.registry import schedule_kind, schedules

_RECORDED_STEPS = 3  # steps recorded after training; the one of median makespan is reported


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# The defaults make each task's compute dominate eager PyTorch's per-op overhead (~10 us):
# micro-batches of 1024 / 8 = 128 rows through Linear(512) layers are a few ms per task
# (rows of 16 through Linear(256) were mostly overhead). 9 hidden layers give each of 2
# cells 4 of the 512 x 512 layers, so the cells balance; a default run takes seconds.


def _schedule_help() -> str:
    kinds = "; ".join(f"{name}: {schedule_kind(name).summary}" for name in schedules())
    return (
        f"the order of a training step's tasks, in one process and across processes (default "
        f"1f1b). {kinds}. The demo runs 2 cells per worker under interleaved and zbv"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpipe_fast demo",
        description="Train a deep MLP on synthetic data (a fixed random teacher network) with "
        "GPipe (pipe.train_step) over the devices present (all GPUs, or K CPU workers) and, on "
        "the same data in alternating blocks of steps, the plain model on all cores (or one "
        "GPU); then explain the throughputs from one step's timeline, and draw it.",
    )
    parser.add_argument("--steps", type=_positive, default=20, help="training steps (default 20)")
    parser.add_argument(
        "--model",
        choices=["mlp", "unet"],
        default="mlp",
        help="mlp: the deep MLP (default); unet: a small conv U-Net denoising images, whose "
        "skip connections cross cells (gpipe_fast.skip), and with --processes travel between "
        "the processes; --width and --depth are the MLP's",
    )
    parser.add_argument(
        "--cells",
        type=_positive,
        default=None,
        help="workers in one process (default: the number of GPUs, else 2 on CPU), each "
        "running one cell, or 2 under interleaved and zbv; across processes each process is "
        "one worker (--processes)",
    )
    parser.add_argument("--chunks", type=_positive, default=8, help="M, micro-batches (default 8)")
    parser.add_argument(
        "--checkpoint",
        choices=["always", "except_last", "never"],
        default="except_last",
        help="which micro-batches' activations are recomputed in the backward (default "
        "except_last)",
    )
    parser.add_argument("--schedule", choices=schedules(), default="1f1b", help=_schedule_help())
    parser.add_argument("--width", type=_positive, default=512, help="hidden width (default 512)")
    parser.add_argument("--depth", type=_positive, default=9, help="hidden layers (default 9)")
    parser.add_argument(
        "--batch",
        type=_positive,
        default=None,
        help="mini-batch size (default 1024 for the MLP, 64 images for the U-Net)",
    )
    parser.add_argument(
        "--lr", type=float, default=3e-4, help="Adam's learning rate (default 3e-4)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the weights and the data (default 0)"
    )
    parser.add_argument(
        "--processes",
        type=_positive,
        default=1,
        help="P > 1: train with one worker per process (its cells as --schedule gives), P "
        "processes started here and joined by gloo over 127.0.0.1 (default 1: one process)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gpipe_fast_out"),
        help="folder for the timeline of one step: timeline.trace.json (ui.perfetto.dev), "
        "timeline.svg (a web browser) and, with matplotlib, timeline.png (default "
        "./gpipe_fast_out)",
    )
    return parser


def _devices(cells: int | None) -> list[torch.device]:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        cells = cells or count
        return [torch.device("cuda", k % count) for k in range(cells)]
    return [torch.device("cpu")] * (cells or 2)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _rival(devices: Sequence[torch.device]) -> str:
    """Where the plain model trains, in words."""
    if devices[0].type == "cuda":
        return f"one GPU, {devices[0]}"
    threads = _plural(torch.get_num_threads(), "intra-op thread")
    return f"{_plural(cpu_cores(), 'core')} with torch's default of {threads}"


# -- training ---------------------------------------------------------------------------------


StepFn = Callable[[Tensor, Tensor], Tensor]  # (x, y) -> the loss, its gradients computed


def _plain_step(model: nn.Module) -> StepFn:
    def step(x: Tensor, y: Tensor) -> Tensor:
        out = model(x)
        loss = nn.functional.mse_loss(out, y.to(out.device))
        loss.backward()
        return loss

    return step


def _pipe_step(pipe: gf.GPipe) -> StepFn:
    return lambda x, y: pipe.train_step(x, y, nn.functional.mse_loss)


@dataclass
class _Trainee:
    """A model in training: its losses, and the seconds per step of each timed block."""

    name: str
    step: StepFn
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # one per timed block

    @classmethod
    def adam(cls, name: str, model: nn.Module, step: StepFn, lr: float) -> _Trainee:
        return cls(name, step, torch.optim.Adam(model.parameters(), lr=lr))

    def train(self, batches: Sequence[Batch], timed: bool) -> None:
        start = time.perf_counter()
        for x, y in batches:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.step(x, y)
            self.optimizer.step()
            self.losses.append(loss.item())  # waits for the step, on a GPU too
        if timed:
            self.step_seconds.append((time.perf_counter() - start) / len(batches))

    def throughput(self, batch: int) -> float:
        """Samples per second, from the median block."""
        return batch / statistics.median(self.step_seconds)

    def loss_drop(self) -> tuple[float, float, int]:
        """Mean loss of the first and of the last steps, and how many steps each."""
        window = max(1, min(10, len(self.losses) // 2))  # short runs: first half vs last half
        first = sum(self.losses[:window]) / window
        return first, sum(self.losses[-window:]) / window, window


def _block_steps(steps: int) -> int:
    """Steps per block: about ten blocks, so that noise on a shared machine hits both."""
    return max(1, min(5, steps // 10))


def _train_side_by_side(trainees: Sequence[_Trainee], data: Sequence[Batch]) -> int:
    """Trains each model on every batch, in alternating blocks of steps (the order flipped
    each block), timing every block but the first (warm-up). Returns the timed blocks."""
    size = _block_steps(len(data))
    blocks = [data[i : i + size] for i in range(0, len(data), size)]
    names = " + ".join(t.name for t in trainees)
    with tqdm(total=len(data), desc=names, unit="step") as progress:
        for b, block in enumerate(blocks):
            order = trainees if b % 2 == 0 else list(reversed(trainees))
            for trainee in order:
                trainee.train(block, timed=b > 0 or len(blocks) == 1)
            progress.update(len(block))
            progress.set_postfix(loss=" / ".join(f"{t.losses[-1]:.4f}" for t in trainees))
    return len(trainees[0].step_seconds)


# -- the step's timeline ----------------------------------------------------------------------


def _record_step(pipe: gf.GPipe, x: Tensor, y: Tensor) -> gf.Timeline:
    """One more train_step with the timeline recorded (no optimizer step)."""
    pipe.record_timeline()
    pipe.train_step(x, y, nn.functional.mse_loss)
    timeline = pipe.timeline()
    pipe.record_timeline(False)
    pipe.zero_grad(set_to_none=True)
    return timeline


def _median_step(pipe: gf.GPipe, x: Tensor, y: Tensor) -> gf.Timeline:
    recorded = [_record_step(pipe, x, y) for _ in range(_RECORDED_STEPS)]
    return sorted(recorded, key=lambda timeline: timeline.makespan)[len(recorded) // 2]


def _plain_work(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """The plain model's forward, loss and backward on one mini-batch, timed alone (s)."""
    costs = alone.time_cell_alone(model, x, needs_input_grad=False, threads=None, repeats=3)
    with torch.no_grad():
        out = model(x)
    loss = alone.time_loss_alone(out, y.to(out.device), nn.functional.mse_loss, repeats=3)
    model.zero_grad(set_to_none=True)
    return costs.forward + costs.backward + loss


def _time_alone(
    pipe: gf.GPipe, plain: nn.Module, x: Tensor, y: Tensor, rounds: int = 3
) -> tuple[list[StageCosts], float]:
    """The cells and the plain model timed alone in alternating rounds (medians), so that the
    work they are compared on meets the same noise."""
    cells, plain_work = [], []
    for _ in range(rounds):
        loss = (y, nn.functional.mse_loss)
        cells.append(alone.time_cells_alone(pipe, x, repeats=3, loss=loss))
        plain_work.append(_plain_work(plain, x, y))
    medians = [alone.median_costs([r[k] for r in cells]) for k in range(len(cells[0]))]
    return medians, statistics.median(plain_work)


# -- printing ---------------------------------------------------------------------------------


def _peak_rss_mib() -> float | None:
    """The process's peak resident set size, where the platform reports it."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes vs KiB


def _print_setup(
    pipe: gf.GPipe, model: nn.Sequential, args: argparse.Namespace, rival: str, workers: int
) -> None:
    threads = pipe.threads_per_cell
    cells = len(pipe.balance)
    each = "" if workers == cells else f" ({cells // workers} per worker)"
    report.say(
        f"gpipe_fast demo: {len(model)} layers, {sum(p.numel() for p in model.parameters()):,} "
        f"parameters, schedule {pipe.schedule!r}, K={cells} cells {pipe.balance} on "
        f"{[str(d) for d in pipe.devices[:workers]]}{each}, M={args.chunks}, "
        f"checkpoint={args.checkpoint!r}, "
        f"threads per cell: {'default' if threads is None else threads} "
        f"({pipe.threads_reason})"
    )
    report.say(
        f"against the plain model on {rival}: same initial weights, data and optimizer, "
        f"trained in alternating blocks of {_plural(_block_steps(args.steps), 'step')}"
    )


def _print_training(trainees: Sequence[_Trainee], batch: int, blocks: int) -> float:
    """Prints the losses and throughputs; returns gpipe_fast's throughput over the rival's."""
    drops = [t.loss_drop() for t in trainees]
    window = drops[0][2]
    report.say(
        "loss: "
        + ", ".join(
            f"{t.name} {d[0]:.4f} -> {d[1]:.4f}" for t, d in zip(trainees, drops, strict=True)
        )
        + f" (mean of the first and of the last {window} steps)"
    )
    pipe, plain = (t.throughput(batch) for t in trainees)
    report.say(
        f"throughput: gpipe_fast {pipe:,.0f} samples/s, plain model {plain:,.0f} samples/s: "
        f"{pipe / plain:.2f}x (median of {blocks} timed blocks each)"
    )
    return pipe / plain


def _ideal(timeline: gf.Timeline) -> str:
    """The ideal bubble and what it is, for the bubble line."""
    kind = schedule_kind(timeline.schedule)
    cells, workers, m = timeline.cells, len(timeline.compute_rows()), timeline.microbatches
    formula = kind.stages_per_worker == 1 and not kind.split_backward  # gpipe, 1f1b
    return (
        f"ideal {timeline.ideal_bubble:.1%} for {timeline.schedule} with K={cells}"
        + ("" if workers == cells else f" cells on {workers} workers")
        + f", M={m} "
        + ("((K-1)/(M+K-1))" if formula else "(equal cells, no overhead, simulated)")
    )


def _print_step(
    timeline: gf.Timeline, workers: Sequence[report.WorkerBreakdown], simulated: float
) -> None:
    report.say(
        f"one step of gpipe_fast (the median of {_RECORDED_STEPS} recorded): makespan "
        f"{timeline.makespan * 1e3:.1f} ms, per worker (the cells it runs): compute and "
        f"recompute timed alone outside the pipe; overhead, the tasks' time beyond that (the "
        f"GIL, cores taken by other work) and hand-offs between tasks; idle, waiting for the "
        f"other workers"
    )
    print(report.format_breakdown(workers))
    handoffs = report.total_share(workers, lambda w: w.handoff_s)
    report.say(
        f"bubble: measured {timeline.bubble():.1%} of worker time (idle and hand-offs: "
        f"{timeline.bubble() - handoffs:.1%} + {handoffs:.1%}), {_ideal(timeline)}, "
        f"{simulated:.1%} with these cells' costs timed alone"
    )


def _print_load(cores: int) -> None:
    """Says so when other work shared the cores as the demo started: its timings are noisy."""
    if not hasattr(os, "getloadavg"):
        return
    load = os.getloadavg()[0]
    if load >= 0.5 * cores:
        report.say(
            f"note: load average {load:.1f} on {cores} cores when the demo started: other work "
            f"shares the cores, so these timings are noisy"
        )


def _print_memory(pipe: gf.GPipe) -> None:
    rss = _peak_rss_mib()
    if rss is not None:
        print(f"peak RSS of the process: {rss:.1f} MiB")
    if torch.cuda.is_available():
        peak = max(torch.cuda.max_memory_allocated(d) for d in pipe.devices)
        print(f"peak GPU memory allocated: {peak / 2**20:.1f} MiB")


# -- the job ----------------------------------------------------------------------------------


def _pipe(model: nn.Sequential, devices: Sequence[torch.device], args: argparse.Namespace
          ) -> tuple[gf.GPipe, int]:  # fmt: skip
    """The pipe of `model` under the schedule asked for, and its workers: one per device, each
    running cells_per_worker cells (at most as many cells as layers)."""
    per_worker = cells_per_worker(args.schedule)
    workers = max(1, min(len(devices), len(model) // per_worker))  # the MLP has 3 layers or more
    pipe = gf.GPipe(model, gf.balance_by_params(workers * per_worker, model),
                    devices=list(devices[:workers]), chunks=args.chunks,
                    checkpoint=args.checkpoint, schedule=args.schedule)  # fmt: skip
    return pipe, workers


def arguments(argv: Sequence[str]) -> argparse.Namespace:
    """The demo's options from the command line `argv`, defaults filled in (exits with the
    usage and the error on a bad one, as argparse does)."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    if args.batch is None:
        args.batch = 64 if args.model == "unet" else 1024
    if args.processes > 1 and args.cells is not None:
        parser.error("--cells is for one process: across processes each process is one worker")
    return args


def run_demo(argv: list[str]) -> int:
    """Runs the demo; 0 when gpipe_fast's loss went down."""
    args = arguments(argv)
    if args.processes > 1:
        return processes.run(args)
    torch.manual_seed(args.seed)
    devices = _devices(args.cells)
    model, data = workload(args, devices[0])
    plain = copy.deepcopy(model).to(devices[0])  # the same initial weights
    pipe, workers = _pipe(model, devices, args)
    try:
        _print_load(cpu_cores())
        rival = _rival(devices)
        _print_setup(pipe, model, args, rival, workers)
        trainees = [
            _Trainee.adam("gpipe_fast", pipe, _pipe_step(pipe), args.lr),
            _Trainee.adam("plain model", plain, _plain_step(plain), args.lr),
        ]
        blocks = _train_side_by_side(trainees, data)
        ratio = _print_training(trainees, args.batch, blocks)

        x, y = data[-1]
        timeline = _median_step(pipe, x, y)
        costs, plain_work = _time_alone(pipe, plain, x, y)
        per_worker = report.breakdown(timeline, costs, pipe.threads_per_cell)
        _print_step(timeline, per_worker, report.simulated_bubble(timeline, costs))
        comparison = report.Comparison(
            ratio=ratio,
            rival=rival,
            plain_work_s=plain_work,
            workers=per_worker,
            on_cpu=all(d.type == "cpu" for d in pipe.devices),
        )
        report.say(comparison.work_line())
        report.say(comparison.verdict())
        report.write_timeline(timeline, args.out, "open in ui.perfetto.dev or chrome://tracing")
        _print_memory(pipe)
    finally:
        pipe.close()
    first, last, _ = trainees[0].loss_drop()
    return 0 if last < first else 1

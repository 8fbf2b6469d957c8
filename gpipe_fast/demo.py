"""The demo job: trains a deep MLP on synthetic data through GPipe and reports what it saw."""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm  # type: ignore[import-untyped]

import gpipe_fast as gf
from gpipe_fast.timeline import Phase


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpipe_fast demo",
        description="Train a deep MLP on synthetic data (a fixed random teacher network) with "
        "GPipe over the devices present: all GPUs, or K CPU cells.",
    )
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument(
        "--cells",
        type=int,
        default=None,
        help="K, cells (default: number of GPUs, else 2 CPU cells)",
    )
    parser.add_argument("--chunks", type=int, default=8, help="M, micro-batches (default 8)")
    parser.add_argument(
        "--checkpoint", choices=["always", "except_last", "never"], default="except_last"
    )
    parser.add_argument("--width", type=int, default=256, help="hidden width (default 256)")
    parser.add_argument("--depth", type=int, default=8, help="hidden layers (default 8)")
    parser.add_argument("--batch", type=int, default=128, help="mini-batch size (default 128)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gpipe_fast_out"),
        help="folder for the timeline of one step: timeline.trace.json and, with "
        "matplotlib, timeline.png (default ./gpipe_fast_out)",
    )
    return parser


def _model(width: int, depth: int, inputs: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def _devices(cells: int | None) -> list[torch.device]:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        cells = cells or count
        return [torch.device("cuda", k % count) for k in range(cells)]
    return [torch.device("cpu")] * (cells or 2)


def _train(
    model: nn.Module,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    device: torch.device,
    progress: tqdm | None,
) -> tuple[list[float], float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    start = time.perf_counter()
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        loss = nn.functional.mse_loss(out, y.to(out.device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{losses[-1]:.4f}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return losses, time.perf_counter() - start


def _record_step(pipe: gf.GPipe, x: torch.Tensor, y: torch.Tensor) -> gf.Timeline:
    """One more forward and backward with the timeline recorded (no optimizer step)."""
    pipe.record_timeline()
    out = pipe(x)
    nn.functional.mse_loss(out, y.to(out.device)).backward()
    timeline = pipe.timeline()
    pipe.record_timeline(False)
    pipe.zero_grad(set_to_none=True)
    return timeline


def _write_timeline(timeline: gf.Timeline, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "timeline.trace.json"
    timeline.to_chrome_trace(trace)
    print(f"timeline trace: {trace} (open in ui.perfetto.dev or chrome://tracing)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("timeline picture: skipped, needs matplotlib (pip install matplotlib)")
        return
    picture = out / "timeline.png"
    timeline.plot(picture)
    print(f"timeline picture: {picture}")


def _peak_rss_mib() -> float | None:
    """The process's peak resident set size, where the platform reports it."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes vs KiB


def run_demo(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    torch.manual_seed(args.seed)
    devices = _devices(args.cells)
    inputs = 32
    teacher = _model(64, 3, inputs).requires_grad_(False)
    data = []
    for _ in range(args.steps):
        x = torch.randn(args.batch, inputs)
        data.append((x.to(devices[0]), teacher(x)))

    model = _model(args.width, args.depth, inputs)
    baseline = copy.deepcopy(model).to(devices[0])
    layers = len(model)
    cells = min(len(devices), layers)
    pipe = gf.GPipe(
        model,
        gf.balance_by_params(cells, model),
        devices=devices[:cells],
        chunks=args.chunks,
        checkpoint=args.checkpoint,
    )
    print(
        f"gpipe_fast demo: {layers} layers, {sum(p.numel() for p in model.parameters()):,} "
        f"parameters, K={cells} cells {pipe.balance} on {[str(d) for d in pipe.devices]}, "
        f"M={args.chunks}, checkpoint={args.checkpoint!r}"
    )

    with tqdm(total=args.steps, desc="gpipe_fast", unit="step") as progress:
        losses, seconds = _train(pipe, data, args.lr, pipe.devices[-1], progress)
    timeline = _record_step(pipe, *data[-1])
    baseline_steps = max(10, args.steps // 4)
    with tqdm(total=baseline_steps, desc="unpipelined", unit="step") as progress:
        _, baseline_seconds = _train(baseline, data[:baseline_steps], args.lr, devices[0], progress)
    pipe.close()

    window = max(1, min(10, len(losses) // 2))  # short runs: first half vs last half
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    throughput = args.steps * args.batch / seconds
    baseline_throughput = baseline_steps * args.batch / baseline_seconds
    print(f"loss: {first:.4f} (first {window} steps) -> {last:.4f} (last {window} steps)")
    print(
        f"throughput: gpipe_fast {throughput:,.0f} samples/s, unpipelined "
        f"{baseline_throughput:,.0f} samples/s ({throughput / baseline_throughput:.2f}x)"
    )
    print(
        f"bubble of one step (timeline): measured {timeline.bubble():.1%}, ideal "
        f"{timeline.ideal_bubble:.1%} for K={timeline.cells}, M={timeline.microbatches}; "
        f"forward {_phase_ms(timeline, 'forward'):.1f} ms, "
        f"backward {_phase_ms(timeline, 'backward'):.1f} ms"
    )
    _write_timeline(timeline, args.out)
    rss = _peak_rss_mib()
    if rss is not None:
        print(f"peak RSS of the process: {rss:.1f} MiB")
    if torch.cuda.is_available():
        peak = max(torch.cuda.max_memory_allocated(d) for d in pipe.devices)
        print(f"peak GPU memory allocated: {peak / 2**20:.1f} MiB")
    return 0 if last < first else 1


def _phase_ms(timeline: gf.Timeline, phase: Phase) -> float:
    start, end = timeline.phase_window(phase)
    return (end - start) * 1e3

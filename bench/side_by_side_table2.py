"""The shape of the GPipe paper's Table 2 on CPU cells: normalised throughput over K and M.

Model: 8 x (Linear(512, 512) + ReLU), batch 128 (so that M = 32 still has 4 samples per
micro-batch), forward + out.sum().backward(). For K in {1, 2, 4} and M in {1, 4, 8, 32}
a GPipe with devices ["cpu"] * K and balance [8 / K] * K runs the step; every cell is
one intra-op thread (OMP_NUM_THREADS=1 is set before torch loads, so K = 1 is one
thread, not the whole machine). Throughput (samples/s) is normalised to K = 1, M = 1
and printed next to the ideal K x M / (M + K - 1): K cells working in parallel, less
the fill-drain bubble. All 12 configurations run in one process, interleaved round by
round (the order rotated by one each round); each round's throughputs are normalised to
that round's K = 1, M = 1 and the table gives the medians over the rounds. A reference
row runs the unwrapped model on the same M micro-batches one after another on one thread:
what the split alone costs in PyTorch.

On the 2 vCPUs of the development machine, K = 4 puts 4 threads on 2 CPUs: its ideal
assumes 4 devices and cannot be reached; K = 2 is bounded by the machine's two-thread
efficiency, which the script measures and prints as side_by_side_cpu.py does.

With --device cuda the cells are GPUs instead: cell k on cuda:(k mod the number of visible
GPUs), so all cells share cuda:0 on a one-GPU machine; the model and the batch start on
cuda:0 and every step ends with torch.cuda.synchronize(). --width and --batch make the
layers large enough for a GPU (the defaults are the CPU table's).

    python bench/side_by_side_table2.py [--rounds 20] [--checkpoint never] [--json out.json]
    python bench/side_by_side_table2.py --device cuda --width 4096 --batch 4096 --rounds 10
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # one thread per cell, before torch is imported

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from side_by_side_cpu import thread_efficiency
from torch import nn

import gpipe_fast as gf

WIDTH, BATCH, BLOCKS = 512, 128, 8
CELLS, CHUNKS = (1, 2, 4), (1, 4, 8, 32)


def build_model(width: int = WIDTH, device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(BLOCKS)]
    ).to(device)


def cell_devices(cells: int, device: str) -> list[str]:
    """Cell k's device: the CPU, or GPU k mod the GPUs visible."""
    if device == "cpu":
        return ["cpu"] * cells
    return [f"cuda:{k % torch.cuda.device_count()}" for k in range(cells)]


def synchronised(step: Callable[[], None], device: str) -> Callable[[], None]:
    """`step`, ended by a wait for the GPUs: a step's time is its device work's."""
    if device == "cpu":
        return step

    def run() -> None:
        step()
        torch.cuda.synchronize()

    return run


def ideal(k: int, m: int) -> float:
    return k * m / (m + k - 1)


def _label(k: int, m: int) -> str:
    return f"K={k},M={m}" if k else f"plain,M={m}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--checkpoint", default="never", choices=("always", "except_last", "never"))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--batch", type=int, default=BATCH)
    args = parser.parse_args()
    device = "cuda:0" if args.device == "cuda" else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "side_by_side_table2.py: --device cuda needs a CUDA GPU; none is visible",
            file=sys.stderr,
        )
        sys.exit(2)

    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.width, device=device)
    pipes = {
        (k, m): gf.GPipe(
            build_model(args.width, device),
            [BLOCKS // k] * k,
            devices=cell_devices(k, args.device),
            chunks=m,
            checkpoint=args.checkpoint,
        )
        for k in CELLS
        for m in CHUNKS
    }

    def plain_step(model: nn.Sequential, m: int) -> None:
        for micro in x.chunk(m):
            model(micro).sum().backward()

    # Reference row "plain": the unwrapped model on the M micro-batches one after another on
    # one thread, i.e. what splitting the batch costs PyTorch itself, without any pipeline.
    # Each configuration has its own copy of the model, so none finds its weights in cache.
    steps = {key: (lambda pipe=pipe: pipe(x).sum().backward()) for key, pipe in pipes.items()}
    plains = {m: build_model(args.width, device) for m in CHUNKS}
    steps.update({(0, m): (lambda m=m: plain_step(plains[m], m)) for m in CHUNKS})
    steps = {key: synchronised(step, args.device) for key, step in steps.items()}
    keys = list(steps)
    times: dict[tuple[int, int], list[float]] = {key: [] for key in steps}
    efficiency = []
    load_before = os.getloadavg()[0]
    for round_ in range(args.warmup + args.rounds):
        shift = round_ % len(keys)  # rotate the order: no configuration always goes first
        for key in keys[shift:] + keys[:shift]:
            step = steps[key]
            start = time.perf_counter()
            step()
            if round_ >= args.warmup:
                times[key].append(time.perf_counter() - start)
        if round_ >= args.warmup and args.device == "cpu":
            efficiency.append(thread_efficiency(WIDTH, repeats=300))
        print(f"round {round_ + 1}/{args.warmup + args.rounds}", end="\r", flush=True)
    print()
    for pipe in pipes.values():
        pipe.close()

    medians = {key: statistics.median(values) for key, values in times.items()}
    base = medians[(1, 1)]
    # Throughput relative to K=1, M=1 within each round, then the median over the rounds.
    normalised = {
        key: statistics.median(b / t for b, t in zip(times[(1, 1)], values, strict=True))
        for key, values in times.items()
    }
    capacity = statistics.median(efficiency) if efficiency else None
    if capacity is None:
        names = sorted({torch.cuda.get_device_name(d) for d in cell_devices(max(CELLS), "cuda")})
        print(f"devices: {', '.join(names)}; cells on {cell_devices(max(CELLS), 'cuda')}")
    else:
        print(
            f"machine: two threads do {capacity:.2f}x the work of one; load average "
            f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        )
    print(
        f"{args.rounds} rounds; checkpoint={args.checkpoint!r}; width {args.width}, batch "
        f"{args.batch}; throughput normalised to K=1, M=1 in each round, median over rounds "
        f"(K=1, M=1: median {base * 1e3:.1f} ms per step, {args.batch / base:.0f} samples/s)"
    )
    print("measured / ideal")
    print(f"{'':>6}" + "".join(f"{'M=' + str(m):>14}" for m in CHUNKS))
    for k in CELLS:
        cells = (f"{normalised[(k, m)]:.2f} / {ideal(k, m):.2f}" for m in CHUNKS)
        print(f"{'K=' + str(k):>6}" + "".join(f"{cell:>14}" for cell in cells))
    plain_row = (f"{normalised[(0, m)]:.2f}" for m in CHUNKS)
    print(f"{'plain':>6}" + "".join(f"{cell:>14}" for cell in plain_row))
    bound = (
        f"on this machine K >= 2 is further bounded by the two-thread figure ({capacity:.2f})"
        if capacity is not None
        else "cells sharing a GPU share its throughput"
    )
    print(
        f"ideal = K x M / (M + K - 1); {bound}; plain = the unwrapped model on the M "
        f"micro-batches one after another{' (1 thread)' if args.device == 'cpu' else ''}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "checkpoint": args.checkpoint,
                    "device": args.device,
                    "width": args.width,
                    "batch": args.batch,
                    "rounds": args.rounds,
                    "thread_efficiency": capacity,
                    "medians_s": {_label(k, m): v for (k, m), v in medians.items()},
                    "normalised": {_label(k, m): v for (k, m), v in normalised.items()},
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()

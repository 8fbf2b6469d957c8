"""The runtime's cost per task: steps through cells that do nothing (nn.Identity) on CPU.

For K in --cells and M in --chunks: a pipe(x) + backward step (2 K M tasks) and a train_step
under each schedule (its tasks: forwards, losses, backwards or their halves), on a batch of
M x 4 rows of 16 features, loss = the output's sum. The contenders of one (K, M) run
interleaved, round by round; the table gives the median step divided by its number of tasks.

    python bench/task_overhead.py [--cells 2 4 8] [--chunks 8 32 128] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast.api.gpipe import pipeline_of


def _sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.sum()


def contenders(
    cells: int, chunks: int
) -> tuple[dict[str, tuple[Callable[[], object], int]], list[gf.GPipe]]:
    """name -> (one step, its number of tasks), and the pipes to close."""
    x = torch.randn(chunks * 4, 16, requires_grad=True)
    runs: dict[str, tuple[Callable[[], object], int]] = {}
    pipes = []
    for schedule in ("gpipe", "1f1b", "zero_bubble"):
        pipe = gf.GPipe(
            nn.Sequential(*[nn.Identity() for _ in range(cells)]),
            [1] * cells,
            devices=["cpu"] * cells,
            chunks=chunks,
            checkpoint="never",
            schedule=schedule,
        )
        pipes.append(pipe)
        tasks = len(pipeline_of(pipe).schedules.train_step(chunks, "never")[0].tasks)
        runs[f"train_step {schedule}"] = (lambda p=pipe: p.train_step(x, x, _sum), tasks)
        if schedule == "gpipe":
            runs["pipe(x) + backward"] = (lambda p=pipe: p(x).sum().backward(), 2 * cells * chunks)
    return runs, pipes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| K | M | pipe(x) + backward | train_step gpipe | train_step 1f1b | train_step ZB |")
    print("|---|---|---|---|---|---|")
    for cells in args.cells:
        for chunks in args.chunks:
            runs, pipes = contenders(cells, chunks)
            times: dict[str, list[float]] = {name: [] for name in runs}
            names = list(runs)
            for round_ in range(args.rounds + 3):
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    start = time.perf_counter()
                    runs[name][0]()
                    if round_ >= 3:
                        times[name].append(time.perf_counter() - start)
            per_task = {n: statistics.median(times[n]) / runs[n][1] * 1e6 for n in names}
            cells_ = [
                f"{per_task[n]:.1f} us"
                for n in (
                    "pipe(x) + backward",
                    "train_step gpipe",
                    "train_step 1f1b",
                    "train_step zero_bubble",
                )
            ]
            print(f"| {cells} | {chunks} | " + " | ".join(cells_) + " |", flush=True)
            for pipe in pipes:
                pipe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

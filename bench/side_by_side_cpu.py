"""Side-by-side CPU step time: gpipe_fast vs the same micro-batches run sequentially vs torchgpipe.

Workload (issue 2): 8 x (Linear(1024, 1024) + ReLU), batch 256, balance [4, 4] on two CPU
cells, M = 8 micro-batches, checkpoint "never", forward + out.sum().backward(). The
sequential baseline runs the same 8 micro-batches one after another on one thread. All
contenders run in one process, interleaved round by round, each cell worker on one
intra-op thread; the table gives medians and ratios to the sequential time.

A machine line measures how much two threads can really run at once here (the same
matrix products on one thread, then on two): a pipeline of two cells cannot beat
1 / that efficiency, whatever its scheduling.

    python bench/side_by_side_cpu.py [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

import gpipe_fast as gf

WIDTH, BATCH, CHUNKS, BLOCKS = 1024, 256, 8, 8


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)]
    )


def thread_efficiency(width: int = WIDTH, repeats: int = 150) -> float:
    """Work done by two threads at once relative to one (2.0 = two real cores)."""
    a, w = torch.randn(32, width), torch.randn(width, width)

    def work() -> None:
        torch.set_num_threads(1)
        for _ in range(repeats):
            a @ w

    start = time.perf_counter()
    work()
    one = time.perf_counter() - start
    threads = [threading.Thread(target=work) for _ in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    two = time.perf_counter() - start
    return 2 * one / two


def _sum_of_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.sum()


def pipeline_contenders(x: torch.Tensor) -> dict[str, Callable[[], None]]:
    """One training step of gpipe_fast (pipe(x) + backward; train_step under 1f1b and
    zero_bubble) and (if installed) torchgpipe on the workload."""
    # One thread per cell, given: the script set torch.set_num_threads(1) for the sequential
    # baseline, and a pipe keeps a user's own thread setting (threads_per_cell None).
    ours = gf.GPipe(
        build_model(),
        [4, 4],
        devices=["cpu", "cpu"],
        chunks=CHUNKS,
        checkpoint="never",
        threads_per_cell=1,
    )
    assert ours.threads_per_cell == 1, ours.threads_per_cell

    def gpipe_fast() -> None:
        ours(x).sum().backward()

    runs = {"gpipe_fast": gpipe_fast}
    # The same layers through train_step under the 1F1B and zero-bubble schedules (loss:
    # the output's sum, so the gradients are those of out.sum().backward()).
    for schedule in ("1f1b", "zero_bubble"):
        pipe = gf.GPipe(
            build_model(), [4, 4], devices=["cpu", "cpu"], chunks=CHUNKS, checkpoint="never",
            schedule=schedule, threads_per_cell=1,
        )  # fmt: skip

        def train_step(pipe: gf.GPipe = pipe) -> None:
            pipe.train_step(x, x, _sum_of_output)

        runs[f"gpipe_fast {schedule}"] = train_step
    try:
        import torchgpipe
    except ImportError:
        print("torchgpipe not installed (pip install --no-deps torchgpipe==0.0.7): skipped")
    else:
        theirs = torchgpipe.GPipe(
            build_model(), balance=[4, 4], devices=["cpu", "cpu"], chunks=CHUNKS, checkpoint="never"
        )

        def torchgpipe_run() -> None:
            theirs(x).sum().backward()

        runs["torchgpipe 0.0.7"] = torchgpipe_run
    return runs


def contenders(x: torch.Tensor) -> dict[str, Callable[[], None]]:
    sequential_model = build_model()

    def sequential() -> None:
        for micro in x.chunk(CHUNKS):
            sequential_model(micro).sum().backward()

    return {"sequential (1 thread)": sequential, **pipeline_contenders(x)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    torch.set_num_threads(1)  # the sequential baseline's single thread; cells pin their own
    x = torch.randn(BATCH, WIDTH)
    runs = contenders(x)
    times: dict[str, list[float]] = {name: [] for name in runs}
    efficiency = []
    for round_ in range(args.warmup + args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - start)
        if round_ >= args.warmup and round_ % 3 == 0:
            efficiency.append(thread_efficiency())

    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians["sequential (1 thread)"]
    capacity = statistics.median(efficiency)
    print(
        f"machine: two threads do {capacity:.2f}x the work of one "
        f"(floor for a 2-cell pipeline: {1 / capacity:.2f} of sequential)"
    )
    print(f"{'contender':<24}{'median ms':>12}{'vs sequential':>16}")
    for name, median in medians.items():
        print(f"{name:<24}{median * 1e3:>12.1f}{median / base:>16.3f}")
    if "torchgpipe 0.0.7" in medians:
        print(
            f"gpipe_fast is {medians['torchgpipe 0.0.7'] / medians['gpipe_fast']:.2f}x "
            "faster than torchgpipe 0.0.7"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "medians_s": medians,
                    "thread_efficiency": capacity,
                    "rounds": args.rounds,
                    "samples_s": times,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()

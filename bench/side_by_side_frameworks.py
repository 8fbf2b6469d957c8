"""Side-by-side CPU step time: gpipe_fast vs torchgpipe vs torch.distributed.pipelining.

Workload (the one of side_by_side_cpu.py, issue 5): 8 x (Linear(1024, 1024) + ReLU), batch
256, M = 8 micro-batches, balance [4, 4], forward + out.sum().backward() with no
re-materialisation, one intra-op thread per stage. Contenders:

- gpipe_fast: GPipe on devices ["cpu", "cpu"], checkpoint "never", in this process:
  pipe(x).sum().backward() (fill-drain), and train_step with loss output.sum() under the
  "1f1b" and "zero_bubble" schedules;
- torchgpipe 0.0.7: the same, in this process (skipped if not installed);
- torch.distributed.pipelining: PipelineStage + ScheduleGPipe and + Schedule1F1B (loss_fn =
  output.sum(), scale_grads=False, so the gradients are those of out.sum()), one stage per
  process in 2 persistent worker processes joined by gloo over 127.0.0.1;
- unpipelined: the plain model on the whole batch, on 1 and on 2 intra-op threads, and
  on the 8 micro-batches one after another on 1 thread (side_by_side_cpu.py's baseline).

All run in one launch, interleaved round by round: each round runs one step of every
contender, in an order rotated by one each round. A local step is timed here; a pipelining
step is timed from the request to both workers to the last reply (the workers block on
their queues, and this process on the replies, while the others compute); the workers
also report their own step time, the difference being the request/reply overhead (~1 ms).
The table gives medians, ratios of medians and "paired" ratios (the median over rounds of
contender / gpipe_fast within one round); a machine line gives how much work two threads
do at once here relative to one, as in side_by_side_cpu.py.

    python bench/side_by_side_frameworks.py [--rounds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_by_side_cpu import (
    BATCH,
    CHUNKS,
    WIDTH,
    build_model,
    pipeline_contenders,
    thread_efficiency,
)
from worker_pair import WorkerPair, in_gloo_pair, requests_of

SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")
REPLY_TIMEOUT_S = 120.0  # a worker that has not answered by then is considered dead


# -- the torch.distributed.pipelining workers ----------------------------------------------


def _sum_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.sum()


def worker(rank: int, port: int, requests: mp.Queue, replies: mp.Queue, parent: int) -> None:
    """One pipeline stage; runs a step of the named schedule per request until "stop"."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    with in_gloo_pair(rank, port, REPLY_TIMEOUT_S, replies):
        torch.manual_seed(1)
        x = torch.randn(BATCH, WIDTH)
        target = torch.zeros(BATCH)
        schedules = {}
        for name, kind in zip(SCHEDULES, (ScheduleGPipe, Schedule1F1B), strict=True):
            # Each schedule drives its own copy of the stage, as each local contender has its
            # own copy of the model.
            half = build_model()[4 * rank : 4 * rank + 4]
            stage = PipelineStage(half, rank, 2, torch.device("cpu"))
            schedules[name] = kind(stage, CHUNKS, loss_fn=_sum_loss, scale_grads=False)
        replies.put((rank, "ready", 0.0, None))
        for request in requests_of(requests, parent):
            start = time.perf_counter()
            if rank == 0:
                schedules[request].step(x)
            else:
                schedules[request].step(target=target)
            replies.put((rank, request, time.perf_counter() - start, None))


class Workers(WorkerPair):
    """The 2 stage processes; stop() always ends them (stop request, then terminate/kill)."""

    def __init__(self) -> None:
        super().__init__(worker, REPLY_TIMEOUT_S)

    def step(self, schedule: str) -> tuple[float, float]:
        """(request-to-reply seconds, the workers' own step seconds: the longer)."""
        start = time.perf_counter()
        own = max(self.ask(schedule, schedule))
        return time.perf_counter() - start, own


# -- the local contenders ------------------------------------------------------------------


def _timed(run: Callable[[], None]) -> tuple[float, None]:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start, None


def local_contenders(x: torch.Tensor) -> dict[str, Callable[[], None]]:
    plain = build_model()

    def unpipelined(threads: int) -> Callable[[], None]:
        def run() -> None:
            torch.set_num_threads(threads)
            try:
                plain(x).sum().backward()
            finally:
                torch.set_num_threads(1)

        return run

    runs = pipeline_contenders(x)
    runs["unpipelined, 1 thread"] = unpipelined(1)

    def sequential() -> None:
        for micro in x.chunk(CHUNKS):
            plain(micro).sum().backward()

    runs["8 micro-batches in turn, 1 thread"] = sequential
    runs["unpipelined, 2 threads"] = unpipelined(2)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    torch.set_num_threads(1)  # cells pin their own (1 each on 2 cores)
    torch.manual_seed(1)
    x = torch.randn(BATCH, WIDTH)
    runs = local_contenders(x)
    efficiency: list[float] = []
    load_before = os.getloadavg()[0]
    workers = Workers()
    try:
        # Every contender is a step returning (request-to-reply seconds, the workers' own).
        steps: dict[str, Callable[[], tuple[float, float | None]]] = {
            name: (lambda run=run: _timed(run)) for name, run in runs.items()
        }
        for schedule in SCHEDULES:
            steps[f"pipelining {schedule}"] = lambda s=schedule: workers.step(s)
        names = list(steps)
        times: dict[str, list[float]] = {name: [] for name in names}
        own_times: dict[str, list[float]] = {f"pipelining {s}": [] for s in SCHEDULES}
        for round_ in range(args.warmup + args.rounds):
            measured = round_ >= args.warmup
            shift = round_ % len(names)  # rotate the order: no contender always goes first
            for name in names[shift:] + names[:shift]:
                wall, own = steps[name]()
                if measured:
                    times[name].append(wall)
                    if own is not None:
                        own_times[name].append(own)
            if measured and round_ % 3 == 0:
                efficiency.append(thread_efficiency())
            print(f"round {round_ + 1}/{args.warmup + args.rounds}", end="\r", flush=True)
    finally:
        workers.stop()
    print()

    medians = {name: statistics.median(values) for name, values in times.items()}
    own_medians = {name: statistics.median(values) for name, values in own_times.items()}
    capacity = statistics.median(efficiency)
    ours = medians["gpipe_fast"]
    base = medians["unpipelined, 1 thread"]
    print(
        f"machine: two threads do {capacity:.2f}x the work of one; load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(f"{args.rounds} rounds, medians")
    # Paired: the median over rounds of (contender / gpipe_fast) within the same round.
    paired = {
        name: statistics.median(t / o for t, o in zip(values, times["gpipe_fast"], strict=True))
        for name, values in times.items()
    }
    header = (
        f"{'contender':<34}{'ms':>8}{'vs unpipelined 1t':>19}"
        f"{'gpipe_fast speed-up':>21}{'paired':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, median in medians.items():
        print(
            f"{name:<34}{median * 1e3:>8.1f}{median / base:>19.3f}"
            f"{median / ours:>20.2f}x{paired[name]:>7.2f}x"
        )
    for name, median in own_medians.items():
        print(f"  ({name}: {median * 1e3:.1f} ms measured inside the workers)")
    # The best any 2-stage pipeline of these 8 micro-batches can do here: the micro-batches'
    # work in turn, times the fill-drain share (M + K - 1) / (M K), on 2 threads worth
    # `capacity` threads.
    floor = (
        medians["8 micro-batches in turn, 1 thread"] * (CHUNKS + 1) / (2 * CHUNKS) * 2 / capacity
    )
    print(
        f"pipeline floor here: {floor * 1e3:.1f} ms (micro-batches in turn x 9/16 x 2 / "
        f"{capacity:.2f}); " + ", ".join(f"{n} {medians[n] / floor:.2f}x" for n in medians)
    )
    for name in ("gpipe_fast", "gpipe_fast 1f1b", "gpipe_fast zero_bubble"):
        ratio = medians[name] / floor
        verdict = "met" if ratio <= 1.10 else f"missed by {ratio / 1.10:.2f}x"
        print(f"target {name} within 1.10x of the floor: {ratio:.2f}x ({verdict})")
    targets = [("torchgpipe 0.0.7", 2.0)] + [(f"pipelining {s}", 1.4) for s in SCHEDULES]
    for name, target in targets:
        if name in medians:
            ratio = medians[name] / ours
            verdict = "met" if ratio >= target else f"missed by {target / ratio:.2f}x"
            print(
                f"target >= {target}x over {name}: {ratio:.2f}x, paired {paired[name]:.2f}x "
                f"({verdict})"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "medians_s": medians,
                    "paired_speedup": paired,
                    "worker_own_medians_s": own_medians,
                    "thread_efficiency": capacity,
                    "rounds": args.rounds,
                    "samples_s": times,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()

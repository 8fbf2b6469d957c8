"""Two processes, one stage each: gpipe_fast across processes vs torch.distributed.pipelining.

The workload of side_by_side_frameworks.py: 8 x (Linear(1024, 1024) + ReLU), batch 256, M = 8,
two stages of 4 layers, no re-materialisation, loss = the output's sum, one intra-op thread per
process. Two persistent worker processes joined by gloo over 127.0.0.1 each hold, with its own
copy of its stage, every contender:

- gpipe_fast: GPipe(..., pp_group=WORLD) train_step under "gpipe" and "1f1b";
- torch.distributed.pipelining: PipelineStage + ScheduleGPipe and + Schedule1F1B;
- the floor: the stage's own forward and backward of the 8 micro-batches in turn, alone (no
  pipeline), on each rank; a 2-stage pipeline of these can at best take the slower rank's
  time x (M + K - 1) / M.

Rounds interleave the contenders (order rotated each round); a step is timed from the request
to both workers to their last reply. gpipe_fast's communication per step is read from one
recorded step's timeline (its communication worker's send and receive tasks).

    python bench/side_by_side_processes.py [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_by_side_cpu import BATCH, BLOCKS, CHUNKS, WIDTH, build_model
from worker_pair import WorkerPair, join_gloo, leave_gloo, requests_of

CONTENDERS = ("gpipe_fast gpipe", "gpipe_fast 1f1b", "ScheduleGPipe", "Schedule1F1B", "floor")
REPLY_TIMEOUT_S = 300.0
HALF = BLOCKS // 2  # blocks (Linear + ReLU) per rank


def _sum_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.sum()


def _contenders(rank: int, x: torch.Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each contender's step on this rank, and gpipe_fast's pipes (for their timelines)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import gpipe_fast as gf

    steps: dict[str, Any] = {}
    pipes = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = gf.GPipe(
            build_model(),
            [HALF, HALF],
            chunks=CHUNKS,
            checkpoint="never",
            schedule=schedule,
            pp_group=dist.group.WORLD,
        )
        pipes[schedule] = pipe
        steps[f"gpipe_fast {schedule}"] = lambda p=pipe: p.train_step(x, x, _sum_loss)
    target = torch.zeros(BATCH)
    for name, kind in (("ScheduleGPipe", ScheduleGPipe), ("Schedule1F1B", Schedule1F1B)):
        half = build_model()[HALF * rank : HALF * (rank + 1)]
        stage = PipelineStage(half, rank, 2, torch.device("cpu"))
        schedule = kind(stage, CHUNKS, loss_fn=_sum_loss, scale_grads=False)
        steps[name] = (
            (lambda s=schedule: s.step(x))
            if rank == 0
            else (lambda s=schedule: s.step(target=target))
        )
    half = build_model()[HALF * rank : HALF * (rank + 1)]
    inputs = [m.detach().requires_grad_(rank > 0) for m in x.chunk(CHUNKS)]

    def floor() -> None:
        for micro in inputs:
            half(micro).sum().backward()

    steps["floor"] = floor
    return steps, pipes


def _communication(pipe: Any, x: torch.Tensor) -> dict[str, float]:
    """Milliseconds of one recorded step in its sends (posted by the compute worker) and its
    receives (the communication worker's, waiting for the data included)."""
    pipe.record_timeline()
    pipe.train_step(x, x, _sum_loss)
    spans = pipe.timeline().spans  # sends follow their producer; receives on their worker
    pipe.record_timeline(False)
    return {
        "sends_ms": sum(s.duration_s for s in spans if s.kind.startswith("send")) * 1e3,
        "receives_ms": sum(s.duration_s for s in spans if s.kind.startswith("recv")) * 1e3,
    }


def worker(rank: int, port: int, requests: Any, replies: Any, parent: int) -> None:
    """One rank of every contender; runs a step of the named one per request until "stop"."""
    import torch.distributed as dist

    try:
        join_gloo(rank, port, REPLY_TIMEOUT_S)
        torch.manual_seed(1)
        x = torch.randn(BATCH, WIDTH)
        steps, pipes = _contenders(rank, x)
        replies.put((rank, "ready", None, None))
        for request in requests_of(requests, parent):
            if request == "communication":
                value = {s: _communication(p, x) for s, p in pipes.items()}
                replies.put((rank, request, value, None))
                continue
            dist.barrier()  # both ranks start the step together
            start = time.perf_counter()
            steps[request]()
            replies.put((rank, request, time.perf_counter() - start, None))
    except BaseException as error:
        replies.put((rank, "error", None, f"{type(error).__name__}: {error}"))
    finally:
        leave_gloo()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    workers = WorkerPair(worker, REPLY_TIMEOUT_S)
    wall: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    own: dict[str, list[list[float]]] = {name: [] for name in CONTENDERS}
    try:
        for round_ in range(args.warmup + args.rounds):
            shift = round_ % len(CONTENDERS)
            for name in CONTENDERS[shift:] + CONTENDERS[:shift]:
                start = time.perf_counter()
                seconds = workers.ask(name, name)
                if round_ >= args.warmup:
                    wall[name].append(time.perf_counter() - start)
                    own[name].append(seconds)
        communication = workers.ask("communication", "communication")
    finally:
        workers.stop()
    medians = {name: statistics.median(values) for name, values in wall.items()}
    # The floor: the slower rank's compute alone (median over rounds), filled and drained.
    alone = [statistics.median(r[rank] for r in own["floor"]) for rank in range(2)]
    floor = max(alone) * (CHUNKS + 1) / CHUNKS
    rows = []
    for name in CONTENDERS[:-1]:
        rows.append(
            {
                "contender": name,
                "ms": medians[name] * 1e3,
                "vs floor": medians[name] / floor,
            }
        )
    print(
        f"{args.rounds} rounds; each rank's compute alone: "
        f"{alone[0] * 1e3:.1f} ms and {alone[1] * 1e3:.1f} ms; pipeline floor "
        f"{floor * 1e3:.1f} ms (the slower x (M + 1) / M)"
    )
    print(f"{'contender':<20}{'ms':>9}{'vs floor':>10}")
    for row in rows:
        print(f"{row['contender']:<20}{row['ms']:>9.1f}{row['vs floor']:>10.2f}")
    for ours, theirs in (
        ("gpipe_fast gpipe", "ScheduleGPipe"),
        ("gpipe_fast 1f1b", "Schedule1F1B"),
    ):
        print(f"{ours} is {medians[theirs] / medians[ours]:.2f}x {theirs}'s speed (target >= 1.3x)")
    for schedule in ("gpipe", "1f1b"):
        parts = [communication[rank][schedule] for rank in range(2)]
        print(
            f"gpipe_fast {schedule} communication per step (one recorded step): "
            + "; ".join(
                f"rank {r}: sends {p['sends_ms']:.1f} ms, receives {p['receives_ms']:.1f}"
                f" ms (waiting included)"
                for r, p in enumerate(parts)
            )
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "medians_s": medians,
                    "alone_s": alone,
                    "floor_s": floor,
                    "communication_ms": communication,
                    "samples_s": wall,
                },
                out,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

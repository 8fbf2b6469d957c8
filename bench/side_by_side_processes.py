"""Two processes: gpipe_fast against torch.distributed.pipelining, as users run them.

Every schedule of ours against torch's same-named one, on two workloads, one process per
rank (gloo over 127.0.0.1; our tensors between the ranks go through shared memory unless
GPIPE_FAST_TRANSPORT=gloo), with a real loss (MSE against a target) and an SGD step, and the
thread settings left as the user left them (run with and without OMP_NUM_THREADS=1):

- compute-bound: 8 x (Linear(1024, 1024) + ReLU), batch 256, M = 8;
- overhead-bound: 8 x (Linear(128, 128) + ReLU), batch 512, M = 32 (tasks of about 100 us,
  where a runtime's own cost per task and per message shows).

Contenders, each with its own copy of the model and its own optimizer on each rank:

| ours (GPipe(schedule=...)) | torch.distributed.pipelining |
|---|---|
| gpipe | ScheduleGPipe |
| 1f1b | Schedule1F1B |
| interleaved (V = 2) | ScheduleInterleaved1F1B (V = 2) |
| zero_bubble | (none with one stage per rank: ScheduleInterleavedZeroBubble needs V >= 2) |
| zbv | ScheduleZBVZeroBubble |

The floor: each rank's own work alone (its half of the model, forward and backward of the M
micro-batches in turn, and its SGD step) with its share of the cores (half each, both ranks
at once), timed in the same rounds; a two-stage pipeline can at best take the slower rank's
time x (M + 1) / M. Rounds interleave the contenders
(order rotated each round). Every contender and the floor are timed alike, inside the ranks:
each rank times its step from the barrier that starts it on both ranks to its own end, and a
step takes the slower rank's time (the queues that carry the requests are not counted). The
request-to-reply time seen by the driving process is printed apart ("harness"). For our
schedules one recorded step per schedule gives each rank's compute, communication (sends on
the compute worker; receives there too over shared memory, on receiving workers over gloo)
and idle time.

    python bench/side_by_side_processes.py [--workload compute|overhead|both] [--rounds 10]
    OMP_NUM_THREADS=1 python bench/side_by_side_processes.py ...
    GPIPE_FAST_TRANSPORT=gloo python bench/side_by_side_processes.py ...   (ours over gloo)
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
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_pair import WorkerPair, in_gloo_pair, requests_of

WORKLOADS = {  # width, batch, micro-batches
    "compute": (1024, 256, 8),
    "overhead": (128, 512, 32),
}
BLOCKS = 8
PAIRS = (  # (ours, torch's), None where torch has no counterpart
    ("gpipe", "ScheduleGPipe"),
    ("1f1b", "Schedule1F1B"),
    ("interleaved", "ScheduleInterleaved1F1B"),
    ("zero_bubble", None),
    ("zbv", "ScheduleZBVZeroBubble"),
)
REPLY_TIMEOUT_S = 600.0
# This process's intra-op threads before anything was built (torch's contenders run with it).
START_THREADS = torch.get_num_threads()
LR = 1e-3


def build_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                           for _ in range(BLOCKS)])  # fmt: skip


def _stages_of(schedule: str, rank: int) -> list[int]:
    """The stages (of 2 or 4 equal ones) that `rank` runs under `schedule`."""
    if schedule in ("interleaved", "ScheduleInterleaved1F1B"):
        return [rank, rank + 2]
    if schedule in ("zbv", "ScheduleZBVZeroBubble"):
        return [rank, 3 - rank]
    return [rank]


def _ours(schedule: str, width: int, chunks: int, x: Any, y: Any) -> tuple[Any, Any]:
    import torch.distributed as dist

    import gpipe_fast as gf

    cells = 4 if schedule in ("interleaved", "zbv") else 2
    pipe = gf.GPipe(build_model(width), [BLOCKS // cells] * cells, chunks=chunks,
                    checkpoint="never", schedule=schedule, pp_group=dist.group.WORLD)  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad()
        pipe.train_step(x, y, nn.functional.mse_loss)
        opt.step()

    return step, pipe


def _torch(name: str, rank: int, width: int, chunks: int, x: Any, y: Any) -> Any:
    from torch.distributed.pipelining import PipelineStage, schedules

    stages = _stages_of(name, rank)
    count = 4 if len(stages) == 2 else 2
    per = BLOCKS // count
    model = build_model(width)
    pipeline_stages = [
        PipelineStage(model[per * s : per * (s + 1)], s, count, torch.device("cpu")) for s in stages
    ]
    params = [p for stage in pipeline_stages for p in stage.submod.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    kind = getattr(schedules, name)
    arg = pipeline_stages[0] if len(stages) == 1 else pipeline_stages
    schedule = kind(arg, chunks, loss_fn=nn.functional.mse_loss)
    first, last = 0 in stages, count - 1 in stages

    def step() -> None:
        # The threads this process started with: building one of our pipes gave this thread
        # its share of the cores, which a torch user's process would not have.
        ours = torch.get_num_threads()
        torch.set_num_threads(START_THREADS)
        try:
            opt.zero_grad()
            args = (x,) if first else ()
            kwargs = {"target": y} if last else {}
            schedule.step(*args, **kwargs)
            opt.step()
        finally:
            torch.set_num_threads(ours)

    return step


def _floor(rank: int, width: int, chunks: int, x: Any, y: Any) -> Any:
    """This rank's half of the model alone: forward and backward of each micro-batch in
    turn and its SGD step (the last rank's with the loss)."""
    half = build_model(width)[BLOCKS // 2 * rank : BLOCKS // 2 * (rank + 1)]
    opt = torch.optim.SGD(half.parameters(), lr=LR)
    inputs = [m.detach().requires_grad_(rank > 0) for m in x.chunk(chunks)]
    targets = list(y.chunk(chunks))

    # The machine's floor: each rank with its share of the cores (both run at once), however
    # the environment leaves the contenders' threads.
    share = max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                    else os.cpu_count() or 1) // 2)  # fmt: skip

    def step() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(share)
        try:
            opt.zero_grad()
            for micro, target in zip(inputs, targets, strict=True):
                out = half(micro)
                if rank == 1:
                    nn.functional.mse_loss(out, target).backward()
                else:
                    out.backward(torch.ones_like(out))
            opt.step()
        finally:
            torch.set_num_threads(before)

    return step


def _breakdown(pipe: Any, step: Any) -> dict[str, float]:
    """One recorded step: this rank's compute, communication and idle, in ms."""
    from gpipe_fast.schedule.registry import communication_actions

    pipe.record_timeline()
    step()
    timeline = pipe.timeline()
    pipe.record_timeline(False)
    communication = communication_actions()
    spans = timeline.spans
    compute = sum(s.duration_s for s in spans if s.kind not in communication)
    sends = sum(s.duration_s for s in spans if s.kind.startswith("send"))
    receives = sum(s.duration_s for s in spans if s.kind.startswith("recv"))
    makespan = timeline.makespan
    return {"makespan_ms": makespan * 1e3, "compute_ms": compute * 1e3,
            "sends_ms": sends * 1e3, "receives_ms": receives * 1e3,
            "idle_ms": max(0.0, makespan - compute - sends) * 1e3}  # fmt: skip


def worker(rank: int, port: int, requests: Any, replies: Any, parent: int) -> None:
    """Every contender of every workload on this rank; one step of the named one per request."""
    import torch.distributed as dist

    with in_gloo_pair(rank, port, REPLY_TIMEOUT_S, replies, pin_threads=False):
        steps: dict[str, Any] = {}
        pipes: dict[str, Any] = {}
        for workload in json.loads(os.environ["GPIPE_BENCH_WORKLOADS"]):
            width, batch, chunks = WORKLOADS[workload]
            generator = torch.Generator().manual_seed(1)
            x = torch.randn(batch, width, generator=generator)
            y = torch.randn(batch, width, generator=generator)
            for ours, theirs in PAIRS:
                steps[f"{workload}/{ours}"], pipes[f"{workload}/{ours}"] = _ours(
                    ours, width, chunks, x, y
                )
                if theirs is not None:
                    steps[f"{workload}/{theirs}"] = _torch(theirs, rank, width, chunks, x, y)
            steps[f"{workload}/floor"] = _floor(rank, width, chunks, x, y)
        replies.put((rank, "ready", START_THREADS, None))
        for request in requests_of(requests, parent):
            if request == "breakdown":
                value = {name: _breakdown(pipe, steps[name]) for name, pipe in pipes.items()}
                replies.put((rank, request, value, None))
                continue
            dist.barrier()  # both ranks start the step together
            start = time.perf_counter()
            steps[request]()
            replies.put((rank, request, time.perf_counter() - start, None))


def _report(workload: str, wall: dict[str, list[float]], own: dict[str, list[list[float]]],
            breakdown: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    width, batch, chunks = WORKLOADS[workload]
    # The slower rank's own time of each round (the floor's measure too).
    medians = {name: statistics.median(max(r) for r in v) for name, v in own.items() if v}
    harness = statistics.median(w - max(r) for name in wall for w, r in
                                zip(wall[name], own[name], strict=True))  # fmt: skip
    alone = [statistics.median(r[rank] for r in own[f"{workload}/floor"]) for rank in range(2)]
    floor = max(alone) * (chunks + 1) / chunks
    print(f"\n{workload}-bound: 8 x Linear({width}), batch {batch}, M = {chunks}; each rank "
          f"alone {alone[0] * 1e3:.1f} and {alone[1] * 1e3:.1f} ms; "
          f"floor {floor * 1e3:.1f} ms; harness {harness * 1e3:.1f} ms per request, not "
          "counted")  # fmt: skip
    print(f"{'ours':<13}{'ms':>8}{'x floor':>9}   {'torch':<25}{'ms':>8}{'x floor':>9}"
          f"{'ours faster':>13}")  # fmt: skip
    rows = []
    for ours, theirs in PAIRS:
        mine = medians[f"{workload}/{ours}"]
        row: dict[str, Any] = {"ours": ours, "ms": mine * 1e3, "x_floor": mine / floor}
        line = f"{ours:<13}{mine * 1e3:>8.1f}{mine / floor:>9.2f}   "
        if theirs is not None:
            other = medians[f"{workload}/{theirs}"]
            row.update(torch=theirs, torch_ms=other * 1e3, speedup=other / mine)
            line += f"{theirs:<25}{other * 1e3:>8.1f}{other / floor:>9.2f}{other / mine:>12.2f}x"
        else:
            line += f"{'-':<25}"
        print(line)
        rows.append(row)
    print("our timeline per rank (one recorded step): compute / sends / receives / idle ms")
    for ours, _ in PAIRS:
        parts = [breakdown[rank][f"{workload}/{ours}"] for rank in range(2)]
        cells = [
            f"rank {r}: {p['compute_ms']:.1f} / {p['sends_ms']:.1f} / {p['receives_ms']:.1f}"
            f" / {p['idle_ms']:.1f} of {p['makespan_ms']:.1f}"
            for r, p in enumerate(parts)
        ]
        print(f"  {ours:<12}" + "   ".join(cells))
    return {"floor_ms": floor * 1e3, "alone_ms": [a * 1e3 for a in alone], "rows": rows,
            "harness_ms": harness * 1e3,
            "breakdown": [{k: v for k, v in b.items() if k.startswith(workload)}
                          for b in breakdown]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("compute", "overhead", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    os.environ["GPIPE_BENCH_WORKLOADS"] = json.dumps(workloads)  # the spawned workers read it
    omp = os.environ.get("OMP_NUM_THREADS")
    workers = WorkerPair(worker, REPLY_TIMEOUT_S)
    threads = workers.ready
    # Ours between the two ranks: shared memory unless the workers inherit this setting.
    transport = os.environ.get("GPIPE_FAST_TRANSPORT") or "shared memory"
    print(f"OMP_NUM_THREADS={omp or 'unset'}; intra-op threads per rank at start: {threads}; "
          f"ours over {transport}; {args.rounds} rounds, medians")  # fmt: skip
    results: dict[str, Any] = {"omp_num_threads": omp, "threads": threads, "transport": transport}
    try:
        for workload in workloads:
            names = [f"{workload}/{n}" for pair in PAIRS for n in pair if n is not None]
            names.append(f"{workload}/floor")
            wall: dict[str, list[float]] = {name: [] for name in names}
            own: dict[str, list[list[float]]] = {name: [] for name in names}
            for round_ in range(args.warmup + args.rounds):
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    start = time.perf_counter()
                    seconds = workers.ask(name, name)
                    if round_ >= args.warmup:
                        wall[name].append(time.perf_counter() - start)
                        own[name].append(seconds)
            breakdown = workers.ask("breakdown", "breakdown")
            results[workload] = _report(workload, wall, own, breakdown)
    finally:
        workers.stop()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

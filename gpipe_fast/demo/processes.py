"""The demo across processes: `python -m gpipe_fast demo --processes P`.

It trains the demo model (or the U-Net, whose skips then travel between the processes)
with one cell per process, started here and joined by gloo over 127.0.0.1."""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from tqdm import tqdm  # type: ignore[import-untyped]

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.demo import report
from gpipe_fast.demo.workload import cells_per_worker, workload
from gpipe_fast.runtime.timeline import TaskSpan, Timeline
from gpipe_fast.schedule.registry import actions, communication_actions, one_way_actions

# Each process's workers: its compute worker (which also posts the sends, and takes its
# messages itself over shared memory) and the workers receiving activations and gradients
# (idle over shared memory, but for the data-parallel reductions).
_ROWS = ("compute", "receiving activations", "receiving gradients")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=args.processes)
    try:
        results.put(train_rank(rank, args))
    finally:
        dist.destroy_process_group()


def train_rank(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """This rank's part of the demo, in a process group of every rank: it trains its cells
    (the schedule's number per process) and records one more step. Returns what the parent
    reports: its losses, step times, the recorded step's spans and the pipe's facts."""
    torch.manual_seed(args.seed)
    model, data = workload(args, torch.device("cpu"))  # the same weights and batches on every rank
    cells = dist.get_world_size() * cells_per_worker(args.schedule)
    pipe = gf.GPipe(model, gf.balance_by_params(cells, model), chunks=args.chunks,
                    checkpoint=args.checkpoint, schedule=args.schedule,
                    pp_group=dist.group.WORLD)  # fmt: skip
    try:
        optimizer = torch.optim.Adam(pipe.parameters(), lr=args.lr)
        losses, seconds = [], []
        progress = tqdm(total=args.steps, desc="gpipe_fast", unit="step", disable=rank != 0)
        for x, y in data:
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            losses.append(pipe.train_step(x, y, nn.functional.mse_loss).item())
            optimizer.step()
            seconds.append(time.perf_counter() - start)
            progress.update(1)
            progress.set_postfix(loss=f"{losses[-1]:.4f}")
        progress.close()
        pipe.record_timeline()
        x, y = data[-1]
        pipe.train_step(x, y, nn.functional.mse_loss)  # one more step, recorded
        timeline = pipe.timeline()
    finally:
        pipe.close()
    # Every rank hands the parent its own spans (the parent draws them together).
    return {
        "rank": rank,
        "losses": losses,
        "seconds": seconds,
        "spans": timeline.spans,
        "microbatches": timeline.microbatches,
        "threads": pipe.threads_per_cell,
        "threads_reason": pipe.threads_reason,
        "transport": pipe.transport_kind,
        "transport_reason": pipe.transport_reason,
        "balance": pipe.balance,
    }


def _collect(results: Any, processes: list[Any]) -> list[dict[str, Any]] | None:
    """Every process's report (read before joining: a report larger than the pipe's buffer
    holds its process until it is read), or None once one ended without reporting."""
    reports: list[dict[str, Any]] = []
    while len(reports) < len(processes):
        try:
            reports.append(results.get(timeout=1.0))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in processes):
                return None
    return reports


def merged_timeline(spans_by_rank: list[list[TaskSpan]], cells: int, microbatches: int,
                    schedule: str) -> Timeline:  # fmt: skip
    """One timeline of every rank's step, a row per worker that ran a task (and per compute
    worker): rank by rank, its compute worker first (the ranks share the host's steady clock)."""
    used = {(rank, s.row) for rank, ranks_spans in enumerate(spans_by_rank) for s in ranks_spans}
    used |= {(rank, 0) for rank in range(len(spans_by_rank))}
    row_of = {key: row for row, key in enumerate(sorted(used))}
    spans = [
        replace(span, worker=row_of[(rank, span.row)])
        for rank, ranks_spans in enumerate(spans_by_rank)
        for span in ranks_spans
    ]
    origin = min((s.start_s for s in spans), default=0.0)
    spans = [replace(s, start_s=s.start_s - origin, end_s=s.end_s - origin) for s in spans]
    rows = tuple(f"rank {rank} {_ROWS[worker]}" for rank, worker in sorted(used))
    spans.sort(key=lambda s: s.start_s)
    return Timeline(cells=cells, microbatches=microbatches, spans=spans, workers=len(rows),
                    schedule=schedule, row_names=rows)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Starts the processes, waits for them, reports what rank 0 saw; 0 when the loss fell."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    per_process = cells_per_worker(args.schedule)
    each = "one cell" if per_process == 1 else f"{per_process} cells"
    report.say(
        f"gpipe_fast demo across {args.processes} processes (gloo over 127.0.0.1, {each} "
        f"each), model {args.model!r}, schedule {args.schedule!r}, M={args.chunks}, "
        f"checkpoint={args.checkpoint!r}; "
        f"on a cluster: torchrun --nproc-per-node {args.processes} your_script.py"
    )
    processes = [
        context.Process(target=_worker, args=(rank, args, port, results))
        for rank in range(args.processes)
    ]
    for process in processes:
        process.start()
    reports = _collect(results, processes)
    for process in processes:
        process.join()
    if reports is None:
        codes = [process.exitcode for process in processes]
        report.say(f"a process failed (exit codes {codes}); see its error above")
        return 2
    by_rank = sorted(reports, key=lambda r: r["rank"])
    result = by_rank[0]
    losses, seconds = result["losses"], result["seconds"][1:] or result["seconds"]
    window = max(1, min(10, len(losses) // 2))
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    report.say(f"cells {result['balance']}, threads per process: {result['threads'] or 'default'} "
               f"({result['threads_reason']}); tensors between processes: "
               f"{result['transport']} ({result['transport_reason']})")  # fmt: skip
    report.say(
        f"loss: {first:.4f} -> {last:.4f} (mean of the first and of the last {window} steps)"
    )
    print(f"throughput: {args.batch / statistics.median(seconds):,.0f} samples/s (median step)")
    timeline = merged_timeline([r["spans"] for r in by_rank], len(result["balance"]),
                               result["microbatches"], args.schedule)  # fmt: skip
    own = bubble_of_own_tasks(timeline, args.checkpoint)
    report.say(
        f"one step: makespan {timeline.makespan * 1e3:.1f} ms, bubble {timeline.bubble():.1%} "
        f"(ideal {timeline.ideal_bubble:.1%} with equal stages; {own:.1%} with these stages' "
        "own task times and no communication); per rank: "
        + "; ".join(_rank_line(timeline, r) for r in range(args.processes))
    )
    report.write_timeline(timeline, args.out, "every rank's workers")
    return 0 if last < first else 1


def bubble_of_own_tasks(timeline: Timeline, checkpoint: str) -> float:
    """The bubble the step's schedule would have with each of its tasks taking the time it
    took in `timeline` and nothing else (no sends, receives or hand-offs between tasks):
    what the stages themselves leave (their layers, the recomputes of `checkpoint`), against
    which the measured bubble shows the runtime's own cost."""
    communication = communication_actions()
    took = {(s.kind, s.cell, s.microbatch): s.duration_s for s in timeline.spans
            if s.kind not in communication}  # fmt: skip
    workers = len(timeline.compute_rows())
    schedule = _C.make_schedule(timeline.schedule, timeline.cells, workers,
                                timeline.microbatches, checkpoint)  # fmt: skip
    names = actions()
    costs = [took.get((names[t.action], t.stage, t.microbatch), 0.0) for t in schedule.tasks]
    makespan = _C.simulate(schedule, costs).makespan
    return max(0.0, 1.0 - sum(costs) / (workers * makespan)) if makespan > 0 else 0.0


def rank_rows(timeline: Timeline, rank: int) -> list[int]:
    """The rows of rank `rank`'s workers in a merged timeline, its compute worker first."""
    prefix = f"rank {rank} "
    return [row for row, name in enumerate(timeline.row_names) if name.startswith(prefix)]


def communication_ms(timeline: Timeline, rank: int) -> tuple[float, float]:
    """(posting sends, receiving with the wait for the data) of one rank's workers, in ms."""
    rows = rank_rows(timeline, rank)
    spans = [s for s in timeline.spans if s.row in rows]
    sending, receiving = one_way_actions("send"), one_way_actions("receive")
    sends = sum(s.duration_s for s in spans if s.kind in sending)
    receives = sum(s.duration_s for s in spans if s.kind in receiving)
    return sends * 1e3, receives * 1e3


def _rank_line(timeline: Timeline, rank: int) -> str:
    sends, receives = communication_ms(timeline, rank)
    compute_row = rank_rows(timeline, rank)[0]
    # The sends run on the compute worker, and so do the receives over shared memory.
    compute = timeline.working(compute_row) - sends / 1e3
    return (
        f"rank {rank} computes {compute * 1e3:.1f} ms, posts sends {sends:.1f} ms, receives "
        f"{receives:.1f} ms (waiting for the data included)"
    )

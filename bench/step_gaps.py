"""Where a recorded train_step's time goes: each task's wait after it was ready, its length.

For one workload of bench/plan_accuracy.py on 2 CPU cells, `--steps` recorded steps: per
action, the wait from the moment a task could start (its dependencies and its worker's
previous task done) to its start, and its duration, as medians, sums per step and maxima.
A plan built from medians of layers timed apart sees neither a long tail of task lengths
nor long waits; this shows which of the two a step pays.

    python bench/step_gaps.py [--workload 2] [--schedule gpipe] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

import gpipe_fast as gf
from gpipe_fast import _C

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_accuracy import WORKLOADS, _loss, _record


def gaps(timelines: list[gf.Timeline], steps: _C.Schedule) -> dict[str, list[tuple[float, float]]]:
    """Per action, (wait after ready, duration) of each of its tasks over the timelines."""
    names = _C.actions()
    out: dict[str, list[tuple[float, float]]] = {}
    for timeline in timelines:
        spans = {s.task: s for s in timeline.spans if s.phase == "step"}
        last_end: dict[int, float] = {}
        for span in sorted(spans.values(), key=lambda s: s.start_s):
            task = steps.tasks[span.task]
            ends = [spans[d].end_s for d in task.deps if d in spans]
            ready = max([*ends, last_end.get(span.worker, 0.0)])
            out.setdefault(names[task.action], []).append(
                (span.start_s - ready, span.end_s - span.start_s)
            )
            last_end[span.worker] = span.end_s
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", type=int, default=2, help="index into WORKLOADS")
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    model = workload.model()
    x = torch.randn(workload.batch, workload.width)
    half = len(model) // 2
    pipe = gf.GPipe(model, [half, len(model) - half], devices=["cpu"] * 2,
                    chunks=workload.chunks, checkpoint="never", schedule=args.schedule)  # fmt: skip
    try:
        for _ in range(3):
            pipe.train_step(x, x, _loss)
        timelines = _record(pipe, x, args.steps)
    finally:
        pipe.close()
    steps = _C.make_schedule(args.schedule, 2, 2, workload.chunks, "never")
    print(f"{workload.name}, {args.schedule}, {args.steps} steps")
    for action, rows in sorted(gaps(timelines, steps).items()):
        waits, lengths = [w for w, _ in rows], [d for _, d in rows]
        print(
            f"{action:9s} wait after ready: median {statistics.median(waits) * 1e6:6.0f} us, "
            f"{sum(waits) / args.steps * 1e3:6.2f} ms per step, max {max(waits) * 1e3:6.2f} ms; "
            f"length: median {statistics.median(lengths) * 1e6:6.0f} us, "
            f"{sum(lengths) / args.steps * 1e3:6.2f} ms per step, max {max(lengths) * 1e3:6.2f} ms"
        )
    makespans = [max(s.end_s for s in t.spans if s.phase == "step") for t in timelines]
    print(f"median step (tasks' makespan): {statistics.median(makespans) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

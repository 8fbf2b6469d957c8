"""Predicted against measured step time: gf.plan for each schedule vs train_step.

For each workload (the three of issue 10: MLPs of Linear+ReLU layers on 2 CPU cells) and each
schedule ("gpipe", "1f1b", "zero_bubble" on 2 cells; "interleaved" on 4 cells over 2
workers), two predictions are set against the median measured time of
`pipe.train_step(x, x, loss)` with the same balance (loss: the output's sum, so the loss task
costs next to nothing):

- profiled: gf.plan(cost="time"), each layer timed apart, made before the rounds (the
  median of each layer's repeats, and again with statistic="mean": their mean);
- calibrated: gf.plan(calibrate=...) from `--recorded` steps of fill-drain recorded after
  the rounds on the same cells (interleaved, whose 4 cells no other pipe has, from its own).

The schedules of one cell count share one balance (the first plan's). The pipes of one
workload run interleaved, round by round, in one process.

    python bench/plan_accuracy.py [--rounds 15] [--recorded 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

import gpipe_fast as gf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reporting import markdown_table

SCHEDULES = (("gpipe", 2, 2), ("1f1b", 2, 2), ("zero_bubble", 2, 2), ("interleaved", 4, 2))


@dataclass(frozen=True)
class Workload:
    layers: int
    width: int
    batch: int
    chunks: int

    @property
    def name(self) -> str:
        return f"{self.layers} x Linear({self.width}), batch {self.batch}, M={self.chunks}"

    def model(self) -> nn.Sequential:
        torch.manual_seed(0)
        modules: list[nn.Module] = []
        for _ in range(self.layers):
            modules += [nn.Linear(self.width, self.width), nn.ReLU()]
        return nn.Sequential(*modules)


WORKLOADS = (Workload(8, 1024, 256, 8), Workload(12, 512, 128, 4), Workload(8, 256, 128, 8))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.sum()


def measure(workload: Workload, rounds: int, recorded: int) -> list[dict[str, object]]:
    model = workload.model()
    x = torch.randn(workload.batch, workload.width)
    plans, pipes, means = {}, {}, {}
    balances: dict[int, list[int]] = {}  # one balance per cell count, shared by its schedules
    for schedule, cells, workers in SCHEDULES:
        plan = gf.plan(model, x, cells, workload.chunks, schedule=schedule, devices=workers,
                       balance=balances.get(cells), repeats=15)  # fmt: skip
        balances.setdefault(cells, plan.balance)
        means[schedule] = gf.plan(model, x, cells, workload.chunks, schedule=schedule,
                                  devices=workers, balance=plan.balance, repeats=15,
                                  statistic="mean")  # fmt: skip
        pipe = gf.GPipe(model, plan.balance, devices=["cpu"] * workers, chunks=workload.chunks,
                        checkpoint="never", schedule=schedule)  # fmt: skip
        plans[schedule], pipes[schedule] = plan, pipe
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for round_ in range(rounds + 2):  # two rounds of warm-up
        order = list(pipes)
        order = order[round_ % len(order) :] + order[: round_ % len(order)]
        for name in order:
            pipe = pipes[name]
            start = time.perf_counter()
            pipe.train_step(x, x, _loss)
            elapsed = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if round_ >= 2:
                times[name].append(elapsed)
    # Calibrated plans: every schedule predicted from recorded steps of fill-drain on the same
    # cells (interleaved, whose cells differ, from its own).
    timelines = {name: _record(pipes[name], x, recorded) for name in ("gpipe", "interleaved")}
    rows: list[dict[str, object]] = []
    for schedule, cells, workers in SCHEDULES:
        pipe, plan = pipes[schedule], plans[schedule]
        source = "interleaved" if schedule == "interleaved" else "gpipe"
        calibrated = gf.plan(model, x, cells, workload.chunks, schedule=schedule,
                             devices=workers, balance=plan.balance,
                             calibrate=timelines[source])  # fmt: skip
        measured = statistics.median(times[schedule])
        rows.append(
            {
                "workload": workload.name,
                "schedule": schedule,
                "balance": plan.balance,
                "threads": plan.threads,
                "overhead_us": plan.overhead * 1e6,
                "predicted_ms": plan.step_time * 1e3,
                "measured_ms": measured * 1e3,
                "ratio": plan.step_time / measured,
                "mean_ms": means[schedule].step_time * 1e3,
                "mean_ratio": means[schedule].step_time / measured,
                "calibrated_from": source,
                "calibrated_overhead_us": calibrated.overhead * 1e6,
                "calibrated_call_ms": calibrated.call_overhead * 1e3,
                "calibrated_ms": calibrated.step_time * 1e3,
                "calibrated_ratio": calibrated.step_time / measured,
            }
        )
        pipe.close()
    return rows


def _record(pipe: gf.GPipe, x: torch.Tensor, steps: int) -> list[gf.Timeline]:
    """The timelines of `steps` recorded train_steps of `pipe`."""
    pipe.record_timeline()
    timelines = []
    for _ in range(steps):
        pipe.train_step(x, x, _loss)
        timelines.append(pipe.timeline())
    pipe.record_timeline(False)
    return timelines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--recorded", type=int, default=5, help="steps recorded to calibrate")
    args = parser.parse_args()
    rows = [row for workload in WORKLOADS for row in measure(workload, args.rounds, args.recorded)]
    header = [
        "workload",
        "schedule",
        "measured ms (median)",
        "profiled plan ms",
        "profiled / measured",
        "profiled (mean) / measured",
        "calibrated plan ms (from)",
        "calibrated / measured",
    ]
    table = [
        [
            r["workload"],
            r["schedule"],
            f"{r['measured_ms']:.1f}",
            f"{r['predicted_ms']:.1f}",
            f"{r['ratio']:.2f}",
            f"{r['mean_ratio']:.2f}",
            f"{r['calibrated_ms']:.1f} ({r['calibrated_from']})",
            f"{r['calibrated_ratio']:.2f}",
        ]
        for r in rows
    ]
    print(markdown_table(header, table))
    print(f"per-task overhead measured by plan(): {rows[0]['overhead_us']:.0f} us")
    for r in rows:
        if r["schedule"] in ("gpipe", "interleaved"):
            print(
                f"calibrated hand-off per task, {r['workload']}, from {r['schedule']}: "
                f"{r['calibrated_overhead_us']:.0f} us, and {r['calibrated_call_ms']:.2f} ms "
                "per call around the tasks"
            )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Micro-batches in flight per stage and the predicted bubble, for every schedule.

Each stage ends in a counting layer: its forward adds one to a counter and its backward takes
one away, so the counter's peak is how many micro-batches' activations the stage held at
once (checkpoint "never"). One train_step per schedule, K = 4 stages (interleaved and zbv: 8
stages, V = 2 on 4 workers), M = 8 micro-batches. The counter drops at a split backward's
input half; the activations a weight gradient still needs are held until it runs, which the
program shows (held to W). Beside it, the simulator's bubble for the schedule with equal
stages, a backward twice a forward (zero bubble: halves of one forward each).

    python bench/schedule_memory.py
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.planning.predict import StageCosts, predict
from gpipe_fast.schedule.registry import placement

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reporting import markdown_table

WORKERS, CHUNKS = 4, 8


class _Count(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counter: Counter) -> torch.Tensor:  # type: ignore[override]
        ctx.counter = counter
        counter.add(1)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.counter.add(-1)
        return grad, None


class Counter(nn.Module):
    """Counts forwards not yet backwarded (also on its worker's counter); keeps the peak."""

    def __init__(self, worker: Counter | None = None) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.now = self.peak = 0
        self.worker = [] if worker is None else [worker]  # a list: not a submodule

    def add(self, delta: int) -> None:
        with self.lock:
            self.now += delta
            self.peak = max(self.peak, self.now)
        for worker in self.worker:
            worker.add(delta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Count.apply(x, self)  # type: ignore[no-any-return]


def peaks(schedule: str, stages: int) -> tuple[list[int], list[int]]:
    """Peak micro-batches in flight per stage and per worker (all its stages at once)."""
    workers = [Counter() for _ in range(WORKERS)]
    counters = [Counter(workers[w]) for w in placement(schedule, stages, WORKERS)]
    layers: list[nn.Module] = []
    for counter in counters:
        layers += [nn.Linear(16, 16), counter]
    pipe = gf.GPipe(nn.Sequential(*layers), [2] * stages, devices=["cpu"] * WORKERS,
                    chunks=CHUNKS, checkpoint="never", schedule=schedule)  # fmt: skip
    try:
        x = torch.randn(4 * CHUNKS, 16)
        pipe.train_step(x, x, nn.functional.mse_loss)
    finally:
        pipe.close()
    return [c.peak for c in counters], [w.peak for w in workers]


def program_peaks(schedule: str, stages: int, release: tuple[str, ...]) -> list[int]:
    """Per worker, the most stage activations its program holds: forwards whose `release`
    action (of the same stage and micro-batch) has not run yet."""
    peaks = []
    for order in _C.program(schedule, stages, WORKERS, CHUNKS):
        now = peak = 0
        for action, _stage, _m in order:
            now += 1 if action == "forward" else -1 if action in release else 0
            peak = max(peak, now)
        peaks.append(peak)
    return peaks


def megatron_bound(schedule: str, stages: int) -> list[int]:
    """Micro-batch-stages a worker holds at most under Megatron's schedules (M >= K); for
    zbv, which has no closed form here, what its program holds until the input gradient."""
    if schedule == "zbv":
        return program_peaks(schedule, stages, ("backward_input",))
    if schedule == "gpipe":
        return [CHUNKS * stages // WORKERS] * WORKERS
    per_worker = stages // WORKERS
    return [(per_worker - 1) * WORKERS + 2 * (WORKERS - 1 - r) + 1 if per_worker > 1
            else WORKERS - r for r in range(WORKERS)]  # fmt: skip


def predicted_bubble(schedule: str, stages: int) -> float:
    steps = _C.make_schedule(schedule, stages, WORKERS, CHUNKS, "never")
    share = WORKERS / stages  # interleaving cuts each stage's work by V
    costs = [StageCosts(share, 2 * share, share, share)] * stages
    return predict(steps, costs).bubble


def main() -> int:
    rows = []
    for schedule in ("gpipe", "1f1b", "zero_bubble", "interleaved", "zbv"):
        stages = 2 * WORKERS if schedule in ("interleaved", "zbv") else WORKERS
        per_stage, per_worker = peaks(schedule, stages)
        held = program_peaks(schedule, stages, ("backward", "backward_weight"))
        share = WORKERS / stages  # a stage's share of a 1F1B stage's activations
        rows.append(
            [
                schedule,
                f"{stages} on {WORKERS}",
                " ".join(map(str, per_stage)),
                " ".join(map(str, per_worker)),
                " ".join(map(str, megatron_bound(schedule, stages))),
                " ".join(map(str, held)),
                f"{max(held) * share:g}",
                f"{predicted_bubble(schedule, stages):.1%}",
            ]
        )
    header = ["schedule", "stages on workers", "peak in flight per stage",
              "peak per worker", "expected (M; K - k; Megatron; zbv's program)",
              "held to W per worker (program)", "most held, in 1F1B stages",
              "predicted bubble"]  # fmt: skip
    print(f"K = {WORKERS} workers, M = {CHUNKS} micro-batches")
    print(markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

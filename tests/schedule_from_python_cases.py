"""A schedule written in Python (reversed 1F1B) and the cases that run it across processes."""

from __future__ import annotations

from typing import Any

import dist_cases

import gpipe_fast as gf

REVERSED = "reversed_1f1b_test"


def reversed_1f1b(stages: int, workers: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """1F1B taking the micro-batches last first: stage k runs K-k-1 forwards ahead, then one
    forward and one backward in turn, then the backwards left (one stage per worker)."""
    program = []
    order = list(reversed(range(microbatches)))
    for k in range(stages):
        tasks: list[tuple[str, int, int]] = []

        def forward(m: int, k: int = k, tasks: list[tuple[str, int, int]] = tasks) -> None:
            tasks.append(("forward", k, m))
            if k == stages - 1:
                tasks.append(("loss", k, m))

        ahead = min(stages - k - 1, microbatches)
        for m in order[:ahead]:
            forward(m)
        for i, m in enumerate(order[ahead:]):
            forward(m)
            tasks.append(("backward", k, order[i]))
        for m in order[microbatches - ahead :]:
            tasks.append(("backward", k, m))
        program.append(tasks)
    return program


def register_reversed() -> None:
    """Registers the kind once in this process (a worker runs many tests' cases)."""
    if REVERSED not in gf.schedules():
        gf.register_schedule_kind(REVERSED, reversed_1f1b, summary="1F1B, last micro-batch first")


def train(rank: int, world: int, **kwargs: Any) -> dict[str, Any]:
    """dist_cases.train under the reversed kind, registered in this worker first."""
    register_reversed()
    return dist_cases.train(rank, world, schedule=REVERSED, **kwargs)


def evaluate(rank: int, world: int, **kwargs: Any) -> dict[str, Any]:
    """dist_cases.evaluate (the forward-only run across processes) under the reversed kind."""
    register_reversed()
    return dist_cases.evaluate(rank, world, schedule=REVERSED, **kwargs)

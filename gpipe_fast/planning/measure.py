"""One candidate measured on the real job: a few steps on every rank at once, the first recorded.

The step time is the slowest rank's median; the recorded steps give every cell's median task
costs (gathered from the ranks that run them), gf.plan's calibration. Small steps run more
often, so that a candidate is timed for about MIN_TIMED_S whatever its step."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpipe_fast import _C
from gpipe_fast.api.auto import Config
from gpipe_fast.planning.agree import Agreement
from gpipe_fast.planning.calibrate import cell_costs, solve_handoff
from gpipe_fast.planning.predict import StageCosts

# Steps run before the timed ones (the first builds schedules and warms caches), and timed
# and recorded (their tasks' spans calibrate gf.plan).
WARMUP_STEPS = 1
TIMED_STEPS = 5
# Then more timed steps (not recorded) until the timed ones last about MIN_TIMED_S, at most
# MOST_TIMED_STEPS in all: a step of a few milliseconds varies by more than the 5% that tells
# candidates apart, and its median over five steps with it.
MIN_TIMED_S = 0.3
MOST_TIMED_STEPS = 40
# A side-by-side turn runs a candidate's steps one after another for about TURN_S (BLOCK
# steps at least) and times the latter half, as a training loop runs them: the first steps
# after another pipe's find its threads asleep and its caches cold. Steps of a few
# milliseconds take several steps to settle (overhead-bound, on a 2-core host: 4-8 steps,
# and two-step turns ranked one micro-batch first where, settled, two ran 15% faster).
BLOCK = 2
TURN_S = 0.05
# Before the first candidate the pipe runs about WARM_UP_S of steps: a fresh process's first
# steps run slower (its heap, the rings between the ranks, the caches growing), and so would
# the first candidates measured seem (by 20-40% across processes on a 2-core host).
WARM_UP_S = 0.5


@dataclass(frozen=True)
class Measurement:
    """A candidate as it ran: the median step of the slowest rank, each cell's median task
    costs over the recorded steps, and their median makespan (the slowest rank's)."""

    seconds: float
    costs: list[StageCosts]
    makespan: float
    steps: int = TIMED_STEPS  # timed steps

    def handoff(self, config: Config, workers: int, *, with_loss: bool = True) -> float:
        """The runtime's seconds per task that make the recorded steps as long as they were
        (`with_loss` False: the loss left out of the costs, as gf.plan's profile has none)."""
        cut = config.cut
        schedule = _C.make_schedule(cut.schedule, len(cut.balance), workers,
                                    config.chunks, config.checkpoint)  # fmt: skip
        costs = self.costs
        if not with_loss:
            costs = [StageCosts(c.forward, c.backward, c.backward_input, c.backward_weight)
                     for c in costs]  # fmt: skip
        return solve_handoff(schedule, costs, self.makespan)

    def timed_at(self, seconds: float) -> Measurement:
        """This measurement with its step timed at `seconds`. Where the recorded steps'
        makespan is longer (recording costs a little per task, and the first timed steps
        had not yet settled: 404 against 360 ms, a LLaMA in one process), their task costs
        are scaled down to it, so that gf.plan's calibration and the chosen plan add up to
        the step as it was timed rather than to the slower recorded ones."""
        scale = min(1.0, seconds / self.makespan) if self.makespan > 0 else 1.0
        return dataclasses.replace(self, seconds=seconds, makespan=self.makespan * scale,
                                   costs=[c.scaled(scale) for c in self.costs])  # fmt: skip

    @property
    def call(self) -> float:
        """Seconds of a step outside the recorded tasks (splitting, the loss's agreement)."""
        return max(0.0, self.seconds - self.makespan)


def measure(pipe: Any, config: Config, step: Callable[[Any], Any], agreement: Agreement,
            ) -> Measurement:  # fmt: skip
    """Runs `step(pipe)` with `config`'s micro-batches and checkpointing: WARMUP_STEPS
    steps, then TIMED_STEPS timed and recorded, then more timed until they last about
    MIN_TIMED_S (the count agreed by every rank, which calls it at once). Gradients are set to
    None before each step (as ``optimizer.zero_grad()`` leaves them)."""
    pipe.chunks, pipe.checkpoint = config.chunks, config.checkpoint
    params = list(pipe.parameters())
    times, timelines = [], []
    try:
        for _ in range(WARMUP_STEPS):
            _timed(pipe, step, params)
        pipe.record_timeline()
        for _ in range(TIMED_STEPS):
            times.append(_timed(pipe, step, params))
            timelines.append(pipe.timeline())
        pipe.record_timeline(False)
        for _ in range(_steps_for(MIN_TIMED_S, statistics.median(times), agreement) - TIMED_STEPS):
            times.append(_timed(pipe, step, params))
    finally:
        pipe.record_timeline(False)
        for param in params:
            param.grad = None
    local = cell_costs(timelines, pipe.layout.local_cells)
    found: dict[int, StageCosts] = {}
    for part in agreement.gathered(local):
        found.update(part)
    recorded = Measurement(
        seconds=agreement.slowest(statistics.median(times)),
        costs=[found[cell] for cell in range(len(config.cut.balance))],
        makespan=agreement.slowest(statistics.median(t.makespan for t in timelines)),
        steps=len(times),
    )
    return recorded.timed_at(recorded.seconds)


def turn_steps(typical: float, turn_s: float | None = None, least: int = BLOCK) -> int:
    """The steps of a side-by-side turn for steps of about `typical` seconds: about `turn_s`
    of them (None: TURN_S), `least` at least."""
    turn_s = TURN_S if turn_s is None else turn_s
    return max(least, math.ceil(turn_s / max(typical, 1e-9)))


def side_by_side(pipes: Sequence[Any], configs: Sequence[Config], step: Callable[[Any], Any],
                 agreement: Agreement, rounds: int, turn: int = BLOCK) -> list[float]:  # fmt: skip
    """Each config's median step (the slowest rank's) over `rounds` rounds, in turn (the
    order rotated each round), on its pipe (`pipes[i]`, already warm). Each turn runs `turn`
    steps one after another (the same count on every rank: see turn_steps) and times the
    latter half."""
    times: list[list[float]] = [[] for _ in configs]
    for index in range(rounds):
        shift = index % len(configs)
        for which in [*range(shift, len(configs)), *range(shift)]:
            pipe, config = pipes[which], configs[which]
            pipe.chunks, pipe.checkpoint = config.chunks, config.checkpoint
            params = list(pipe.parameters())
            for block in range(turn):
                seconds = _timed(pipe, step, params)
                if block >= turn // 2:
                    times[which].append(seconds)
    for pipe in pipes:
        for param in pipe.parameters():
            param.grad = None
    return [agreement.slowest(statistics.median(series)) for series in times]


def warm_up(pipe: Any, step: Callable[[Any], Any], agreement: Agreement) -> None:
    """Runs `step(pipe)` for about WARM_UP_S (at least one step; every rank at once)."""
    params = list(pipe.parameters())
    try:
        first = _timed(pipe, step, params)
        for _ in range(_steps_for(WARM_UP_S, first, agreement) - 1):
            _timed(pipe, step, params)
    finally:
        for param in params:
            param.grad = None


def _timed(pipe: Any, step: Callable[[Any], Any], params: Sequence[torch.Tensor]) -> float:
    """The seconds of one step of `pipe`, from gradients set to None to its devices idle."""
    for param in params:
        param.grad = None
    start = time.perf_counter()
    step(pipe)
    _synchronize(pipe.devices)
    return time.perf_counter() - start


def _steps_for(seconds: float, typical: float, agreement: Agreement) -> int:
    """How many steps of `typical` seconds (the slowest rank's: the same count on every rank)
    last about `seconds`, MOST_TIMED_STEPS at most."""
    typical = agreement.slowest(typical)
    return min(MOST_TIMED_STEPS, math.ceil(seconds / max(typical, 1e-9)))


def _synchronize(devices: Sequence[torch.device]) -> None:
    for device in set(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)

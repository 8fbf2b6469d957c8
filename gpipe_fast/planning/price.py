"""A tuning's candidates, priced by gf.plan: every cut, micro-batch count and checkpoint mode.

A cut is a schedule kind with its cells: a balance (the parameters', the profiled time's,
the memory's, the pipe's own) or, for gf.pipeline, split points. Each candidate gets gf.plan's
profiled prediction and memory, and, once steps were measured, a prediction calibrated
from them (see Fit)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpipe_fast import _C
from gpipe_fast.api.auto import Builder, Config, Cut, current_cut
from gpipe_fast.balancing.balance import balance_by_params, partition
from gpipe_fast.nn.microbatch import Value, as_tensors
from gpipe_fast.planning.candidates import CHECKPOINTS, Candidate
from gpipe_fast.planning.plan import Plan, evaluate, plan_with_costs
from gpipe_fast.planning.planner import Planner, profile_in_rounds
from gpipe_fast.planning.predict import StageCosts, predict
from gpipe_fast.planning.search import chunk_counts, memory_balance
from gpipe_fast.planning.tuning import Fit
from gpipe_fast.schedule.registry import placement, schedule_kind, schedules

# The most micro-batches tried: beyond, each task is too small to pay for its hand-offs.
MOST_CHUNKS = 64
# The optimizer whose state the memory budget counts (the common one; SGD's takes less).
OPTIMIZER = "adamw"
# Each layer's runs before and while gf.plan times it (fewer than gf.plan's own: the ranking
# only picks what to measure, and the measured steps calibrate it).
PROFILE_WARMUP = 1
PROFILE_REPEATS = 3


@dataclass(frozen=True)
class Space:
    """What a tuning may change: the schedule kinds with their cell counts, whether the cut
    (balance, split points) is free, the micro-batch counts and checkpoint modes."""

    kinds: list[tuple[str, int]]  # (kind, cells)
    free_cut: bool
    chunks: list[int]
    checkpoints: list[str]


def space(pipe: Any, builder: Builder, tuned: Any, *, first: bool, moves: bool,
          batch: int, layers: int) -> Space:  # fmt: skip
    """The candidates' space. After the first tuning only chunks and checkpoint change;
    across processes the cells change ranks only when they may `moves`."""
    current = current_cut(pipe)
    cells = len(current.balance)
    workers = worker_count(pipe)
    here = pipe.layout.multi_process is False
    free_cut = first and tuned.cut and (here or moves)
    kinds = [(current.schedule, cells)]
    if first and tuned.schedule:
        kinds = []
        for kind in schedules():
            per = schedule_kind(kind).stages_per_worker
            count = workers * (per or 2) if free_cut else cells
            if count > layers or (per and count != workers * per):
                continue
            if not per and count % workers:
                continue
            try:
                places = placement(kind, count, workers)
            except ValueError:
                continue
            if not (here or moves) and places != list(pipe.layout.stage_ranks):
                continue  # the cells stay on their ranks
            if not here and _ends(places) != _ends(list(pipe.layout.stage_ranks)):
                continue  # the ranks given the input and the target stay the same
            kinds.append((kind, count))
    chunks = [pipe.chunks]
    if tuned.chunks:
        chunks = [m for m in chunk_counts(batch) if m <= MOST_CHUNKS]
    checkpoints = list(CHECKPOINTS) if tuned.checkpoint else [pipe.checkpoint]
    return Space(kinds, free_cut, chunks, checkpoints)


def _ends(places: list[int]) -> tuple[int, int]:
    """The ranks of the first cell (which takes the input) and of the last (the target)."""
    return places[0], places[-1]


def worker_count(pipe: Any) -> int:
    """The pipe's workers: its processes across processes, else its distinct workers."""
    if pipe.layout.multi_process:
        return int(pipe.layout.pp_size)
    return len(set(pipe._pipeline.stage_workers))


@dataclass
class Priced:
    """A candidate with gf.plan's profiled plan of it (None: not priced in seconds)."""

    config: Config
    plan: Plan | None
    peak_memory: int = 0


class Pricing:
    """gf.plan's planners of a tuning (one per set of layers: gf.pipeline's split points
    make their own stages), sharing what they measured, and the candidates they price."""

    def __init__(self, pipe: Any, builder: Builder, sample: Value, workers: int) -> None:
        self.pipe = pipe
        self.builder = builder
        tensors = as_tensors(sample, "input")
        self.sample = tensors[0] if len(tensors) == 1 and not isinstance(sample, tuple) else (
            tuple(tensors))  # fmt: skip
        self.workers = workers
        self._planners: dict[tuple[Any, int], Planner] = {}

    def planner(self, cut: Cut) -> Planner:
        cells = len(cut.balance)
        key = (cut.split_points, cells)
        if key not in self._planners:
            module = self.builder.cells_of(cut, self.pipe)
            shared = next((p for (points, _), p in self._planners.items()
                           if points == cut.split_points), None)  # fmt: skip
            if shared is not None:  # the same layers: what was measured of them holds
                self._planners[key] = dataclasses.replace(shared, cells=cells, _overheads={})
            else:
                self._planners[key] = Planner(module, self.sample, cells, "time", None,
                                              self.workers, PROFILE_WARMUP, PROFILE_REPEATS,
                                              2.0, OPTIMIZER,
                                              copies=self.builder.profiles_copies)  # fmt: skip
        return self._planners[key]

    def cuts(self, kind: str, cells: int, chunks: int, free_cut: bool) -> list[Cut]:
        """The cuts tried for `kind` on `cells` cells at `chunks` micro-batches."""
        found = self._profiled_cuts(kind, cells, free_cut)
        if not free_cut or self.builder.cuts(cells) is not None:
            return _unique(found)
        current = current_cut(self.pipe)
        module = self.builder.cells_of(current, self.pipe)
        planner = self.planner(Cut(kind, (1,) * cells))
        balances = [
            balance_by_params(cells, module),
            partition(planner.layer_costs(chunks, kind).total, cells),
            memory_balance(planner, chunks),
        ]
        if len(current.balance) == cells:
            balances.append(list(current.balance))
        return _unique([Cut(kind, tuple(b)) for b in balances])

    def profile(self, space: Space) -> None:
        """The layers of every cut `space` prices, at each of its micro-batch counts, timed
        together in rounds (planner.profile_in_rounds)."""
        wanted = [
            (self.planner(cut), chunks, kind)
            for kind, cells in space.kinds
            for cut in self._profiled_cuts(kind, cells, space.free_cut)
            for chunks in space.chunks
        ]
        profile_in_rounds(wanted, PROFILE_REPEATS)

    def _profiled_cuts(self, kind: str, cells: int, free_cut: bool) -> list[Cut]:
        """The cuts whose layers `cuts` times (GPipe's balances all share one layer set)."""
        current = current_cut(self.pipe)
        if not free_cut:
            return [dataclasses.replace(current, schedule=kind)]
        splits = self.builder.cuts(cells)
        if splits is None:
            return [Cut(kind, (1,) * cells)]
        found = [Cut(kind, (1,) * cells, points) for points in splits]
        if len(current.balance) == cells and current.split_points is not None:
            found.append(Cut(kind, current.balance, current.split_points))
        return found

    def price(self, config: Config) -> Priced:
        cut = config.cut
        planner = self.planner(cut)
        candidate = Candidate(config.chunks, config.checkpoint, cut.schedule)
        plan = evaluate(planner, list(cut.balance), candidate)
        return Priced(config, plan, plan.peak_memory)

    def profiled_costs(self, config: Config) -> list[StageCosts]:
        """gf.plan's profiled costs of each cell of `config`, one micro-batch's tasks."""
        cut = config.cut
        planner = self.planner(cut)
        return planner.layer_costs(config.chunks, cut.schedule).stages(list(cut.balance))

    def calibrated(self, config: Config, fit: Fit) -> float:
        """The step of `config` as the measured steps calibrate gf.plan: its profiled task
        costs times the fit's scale, the fit's hand-off per task, its call around them, all
        times its schedule kind's correction."""
        cut = config.cut
        fit = fit.of_kind(cut.schedule)
        scaled = [c.scaled(fit.scale) for c in self.profiled_costs(config)]
        schedule = _C.make_schedule(cut.schedule, len(cut.balance), self.workers,
                                    config.chunks, config.checkpoint)  # fmt: skip
        return predict(schedule, scaled, fit.handoff).step_time + fit.call

    def measured_plan(self, config: Config, costs: Sequence[StageCosts], handoff: float,
                      call: float, seconds: float | None = None) -> Plan:  # fmt: skip
        """`config`'s plan with its cells' costs as they were measured (its own steps).
        `seconds`: its step as timed. Where its tasks, simulated in the schedule's order with
        nothing between them, already take longer (they overlapped in the run more than the
        order lets them: two cells sharing one host's cores), their costs are scaled to it,
        so that the plan shows the step as it ran."""
        cut = config.cut
        candidate = Candidate(config.chunks, config.checkpoint, cut.schedule)
        planner = self.planner(cut)
        plan = plan_with_costs(planner, list(cut.balance), candidate, costs, handoff, call)
        if seconds is None or handoff > 0 or plan.step_time <= seconds or seconds <= call:
            return plan
        # No handoff: the simulated makespan is linear in the costs.
        scale = (seconds - call) / (plan.step_time - call)
        return plan_with_costs(planner, list(cut.balance), candidate,
                               [c.scaled(scale) for c in costs], handoff, call)  # fmt: skip


@dataclass
class Ranked:
    """The candidates that fit, fastest predicted first; how many did not fit the memory,
    and why those gf.plan could not price were left out (a layer failing on micro-batches
    that small: BatchNorm on one row)."""

    priced: list[Priced]
    too_big: int
    failures: dict[str, int]


def candidates(pricing: Pricing, space: Space, budget: int | None) -> Ranked:
    """Every candidate of `space` priced, those whose predicted peak fits `budget` bytes."""
    found: dict[Config, Priced] = {}
    too_big = 0
    failures: dict[str, int] = {}
    # The layers are profiled in rounds first (Pricing.profile). A profile the rounds left
    # out is taken where a candidate needs it, the kinds that split the backward first: their
    # profile (with the backward's halves timed apart) also serves the others.
    kinds = sorted(space.kinds, key=lambda kind: not schedule_kind(kind[0]).split_backward)
    try:
        pricing.profile(space)
    except (RuntimeError, ValueError):
        pass  # each failing candidate's own error is told below
    for kind, cells in kinds:
        for chunks in space.chunks:
            try:
                candidate_cuts = pricing.cuts(kind, cells, chunks, space.free_cut)
                for cut in candidate_cuts:
                    for checkpoint in space.checkpoints:
                        config = Config(cut, chunks, checkpoint)
                        if config in found:
                            continue
                        priced = pricing.price(config)
                        if budget is not None and priced.peak_memory > budget:
                            too_big += 1
                            continue
                        found[config] = priced
            except (RuntimeError, ValueError) as error:
                reason = f"{kind} at {chunks} micro-batches: {type(error).__name__}: {error}"
                failures[reason.splitlines()[0][:160]] = 1
    ranked = sorted(found.values(), key=lambda p: (_seconds(p), p.peak_memory))
    return Ranked(ranked, too_big, failures)


def _seconds(priced: Priced) -> float:
    return priced.plan.step_time if priced.plan is not None else float("inf")


# What one measured candidate tells the fit: gf.plan's profiled cell costs, the measured ones,
# the hand-off per task and the seconds around the tasks.
Sample = tuple[Sequence[StageCosts], Sequence[StageCosts], float, float]


def fitted(samples: Sequence[Sample]) -> Fit:
    """The fit of measured candidates, each (profiled costs, measured costs, hand-off per
    task, seconds around the tasks): medians of the measured over the profiled tasks' time,
    of the hand-offs and of the calls."""
    ratios = []
    for profiled, measured, _, _ in samples:
        expected = sum(c.forward + c.backward for c in profiled)
        got = sum(c.forward + c.backward for c in measured)
        if expected > 0:
            ratios.append(got / expected)
    return Fit(
        scale=statistics.median(ratios) if ratios else 1.0,
        handoff=statistics.median(s[2] for s in samples),
        call=statistics.median(s[3] for s in samples),
    )


def _unique(candidate_cuts: list[Cut]) -> list[Cut]:
    return list(dict.fromkeys(candidate_cuts))

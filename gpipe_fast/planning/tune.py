"""pipe.tune, and an "auto" pipe's first step at each input signature: choose by measuring.

gf.plan ranks the candidates (planning/price.py); the best few run a few steps each on the
real job, every rank at once (planning/measure.py); after the first few, the steps measured
calibrate gf.plan, and a candidate runs only while its calibrated prediction comes near the
best step measured. The fastest measured is kept, the same on every rank (the source rank
decides: planning/agree.py), and the pipe is rebuilt with its cut when that changed."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from typing import Any

import torch
from torch import nn

from gpipe_fast.api.auto import (
    INITIAL,
    Builder,
    Config,
    Cut,
    TuneOptions,
    current_cut,
    install_tuner,
)
from gpipe_fast.balancing.balance import balance_by_params
from gpipe_fast.nn.batchnorm import batch_statistics_layers
from gpipe_fast.nn.microbatch import Value, as_tensors, batch_size
from gpipe_fast.planning import measure as measuring
from gpipe_fast.planning.agree import Agreement
from gpipe_fast.planning.built import Built, adopt
from gpipe_fast.planning.measure import Measurement, measure, side_by_side
from gpipe_fast.planning.price import (
    Priced,
    Pricing,
    Space,
    candidates,
    fitted,
    space,
    worker_count,
)
from gpipe_fast.planning.progress import Progress
from gpipe_fast.planning.tuning import Fit, TunedCandidate, Tuning
from gpipe_fast.planning.untouched import untouched

# Candidates run at most; the first few by gf.plan's own ranking (each of another cut or
# micro-batch count), then the pipe's defaults (what it runs without "auto"), the others only
# while the calibrated prediction is within WORTH of the best step measured so far. While the
# measuring has lasted less than CHEAP_S, the next best predicted runs whatever its prediction,
# up to MOST_CHEAP: where steps take milliseconds, gf.plan is 20-40% off (the runtime's own
# costs dominate) and measuring more is what tells the candidates apart, at a small cost.
MOST_MEASURED = 8
FIRST_MEASURED = 3
WORTH = 1.10
CHEAP_S = 3.0
MOST_CHEAP = 24
# The measured candidates within CLOSE of the best (at most FINALISTS, the defaults among
# them when measured within 2 * CLOSE) then run again side by side, in turn for FINAL_ROUNDS
# rounds (more for small steps: about MIN_TIMED_S of timed steps per candidate,
# MOST_FINAL_ROUNDS at most; each turn a few settled steps, measure.turn_steps), so that load
# that came and went between their measurements does not decide between them: on a shared
# host a step's time drifts by 15% from one second to the next.
CLOSE = 0.15
FINALISTS = 4
FINAL_ROUNDS = 3
MOST_FINAL_ROUNDS = 15
# The defaults stay when they ran in the final within TIE of the fastest: "auto" changes the
# pipe only for a configuration measured faster than what it would run without "auto" (on a
# 2-core host, steps of a few milliseconds drift by more than that between seconds, and the
# pick among configurations within 1-3% of each other was the noise's: the bench then timed
# the defaults 6% faster than such a pick).
TIE = 0.03


def tune(pipe: Any, input: Value | None, target: Any, loss_fn: Any, options: TuneOptions,
         key: int) -> Tuning:  # fmt: skip
    """Chooses `pipe`'s configuration for batches like `input` (see GPipe.tune)."""
    auto = pipe._auto
    builder: Builder = auto.builder
    if auto.tuned.chunks:
        _warn_batch_statistics(builder.model)
    agreement = Agreement(pipe.layout)
    first = not auto.tunings
    before = current_cut(pipe)
    # Across processes a GPipe's layers change ranks only at an explicit tune(), and only
    # when every rank holds the whole model.
    moves = (
        pipe.layout.multi_process
        and builder.moves_layers
        and first
        and auto.tuned.cut
        and not options.implicit
        and agreement.everywhere(not _on_meta(builder))
    )
    progress = Progress(MOST_MEASURED, options.progress and agreement.shows_progress)
    inputs = list(as_tensors(input, "input")) if input is not None else []
    built = Built(builder, pipe)
    started = time.perf_counter()
    search: _Search | None = None

    def start() -> int:
        nonlocal search
        progress.show(0, "pricing the candidates with gf.plan")
        batch = batch_size(tuple(inputs), "input")
        the_space = space(pipe, builder, auto.tuned, first=first, moves=moves, batch=batch,
                          layers=builder.most_cells())  # fmt: skip
        search = _Search(pipe, builder, input, the_space, _budget(pipe, options), moves,
                         _defaults(pipe, auto.tuned))  # fmt: skip
        return len(search.ranked)

    def step(target_pipe: Any) -> Any:
        return builder.step(target_pipe, input, target, loss_fn, options.reduction)

    with auto.tuning_now(), untouched([pipe, builder.model], inputs):
        try:
            agreement.decided(start)
            progress.show(0, "warming up")
            _warmed_up(pipe, step, agreement)
            since = time.perf_counter()
            while True:
                config = agreement.decided(
                    lambda: _source(search).next(_elapsed(since), options.budget_s)
                )
                if config is None:
                    break
                done = len(_source(search).measured) if search is not None else 0
                progress.show(done, f"running {config}")
                result, error = _measured(built, config, step, agreement)
                if search is not None:
                    search.record(config, result, error)
            finalists: list[Config] = []
            if not built.exclusive:
                finalists, rounds, turn = agreement.decided(lambda: _source(search).finalists())
            if len(finalists) > 1:
                progress.show(progress.total - 1, f"the best {len(finalists)} side by side")
                pipes = [built.get(config.cut) for config in finalists]
                times = side_by_side(pipes, finalists, step, agreement, rounds, turn)
                if search is not None:
                    search.settle(finalists, times)
            tuning = agreement.decided(
                lambda: _source(search).result(key, time.perf_counter() - started)
            )
        finally:
            built.close()
    adopt(pipe, builder, tuning.choice.cut, before, moves, built.moved_layers)
    tuning.seconds = time.perf_counter() - started
    progress.close(f"chose {tuning.choice}")
    return tuning


def _measured(built: Built, config: Config, step: Any, agreement: Agreement
              ) -> tuple[Measurement | None, BaseException | None]:  # fmt: skip
    """The candidate measured, or why it could not run (in one process only: across
    processes a failed step fails the tuning on every rank)."""
    alone = agreement.pp_group is None and agreement.dp_group is None
    try:
        return measure(built.get(config.cut), config, step, agreement), None
    except (RuntimeError, MemoryError, ValueError, TypeError) as error:
        if not alone:
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None, error


def _warmed_up(pipe: Any, step: Any, agreement: Agreement) -> None:
    """The pipe as built run for a while first (measure.warm_up). In one process a step that
    fails here is left to the candidates, which report it; across processes it fails the
    tuning on every rank."""
    try:
        measuring.warm_up(pipe, step, agreement)
    except (RuntimeError, MemoryError, ValueError, TypeError):
        if agreement.pp_group is not None or agreement.dp_group is not None:
            raise


def _warn_batch_statistics(model: nn.Module) -> None:
    """Says that the micro-batch count about to be chosen by speed changes what the model's
    BatchNorm layers compute (each micro-batch normalised by its own rows' statistics): the
    choice depends on timings, so a step's values could differ from run to run unseen."""
    names = batch_statistics_layers(model)
    if not names:
        return
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    warnings.warn(
        f"gpipe_fast: chunks='auto' with BatchNorm layers that normalise by the batch's "
        f"statistics ({shown}): each micro-batch is normalised by its own rows, so the "
        "micro-batch count the tuning picks by speed (which may differ between runs and "
        "machines) changes the loss and the gradients; give chunks to keep them fixed",
        stacklevel=2,
    )


def _elapsed(since: float) -> float:
    return time.perf_counter() - since


def _source(search: _Search | None) -> _Search:
    assert search is not None, "only the source rank decides"
    return search


def _on_meta(builder: Builder) -> bool:
    model = builder.model
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _defaults(pipe: Any, tuned: Any) -> Config:
    """What the pipe would run without "auto": its cut as built, with GPipe's defaults where
    a setting is tuned (one micro-batch, checkpoint 'except_last')."""
    return Config(current_cut(pipe), 1 if tuned.chunks else pipe.chunks,
                  INITIAL["checkpoint"] if tuned.checkpoint else pipe.checkpoint)  # fmt: skip


def _budget(pipe: Any, options: TuneOptions) -> int | None:
    """The memory a candidate's predicted peak must fit: the one given, else on CUDA the
    smallest device's memory, else none (CPU)."""
    if options.memory_per_device is not None:
        return int(options.memory_per_device)
    cuda = [d for d in pipe.devices if d.type == "cuda"]
    if not cuda:
        return None
    return min(int(torch.cuda.get_device_properties(d).total_memory) for d in cuda)


class _Search:
    """The source rank's side of a tuning: the candidates priced and ranked, which to run
    next, what ran, and the choice."""

    def __init__(self, pipe: Any, builder: Builder, input: Value | None, the_space: Space,
                 budget: int | None, moves: bool, defaults: Config) -> None:  # fmt: skip
        assert input is not None, "the source rank runs cell 0: it has the input"
        self.defaults = defaults
        self.workers = worker_count(pipe)
        self.pricing = Pricing(pipe, builder, input, self.workers)
        self.notes: list[str] = []
        self.first_error: BaseException | None = None
        try:
            ranked = candidates(self.pricing, the_space, budget)
            failure = None if ranked.priced else "; ".join(ranked.failures)
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:
            ranked, failure = None, f"{type(error).__name__}: {error}".splitlines()[0]
        if ranked is not None and not ranked.priced and ranked.too_big:
            raise ValueError(
                f"memory_per_device: no candidate's predicted peak fits {budget} bytes "
                f"({ranked.too_big} priced)"
            )
        self.priced = failure is None and ranked is not None
        if ranked is not None and self.priced:
            self.ranked = ranked.priced
            if ranked.too_big:
                self.notes.append(
                    f"{ranked.too_big} candidates left out: predicted peak over {budget} B"
                )
            self.notes += [f"left out, gf.plan failed on {reason}" for reason in ranked.failures]
        else:  # a layer gf.plan cannot run alone (or on the meta device): run, unpriced
            self.ranked = unpriced(pipe, builder, the_space)
            self.notes.append(f"gf.plan could not price the candidates ({failure}): they ran "
                              "in a fixed order, uncalibrated")  # fmt: skip
        if pipe.layout.multi_process and not moves and the_space.kinds:
            self.notes.append("across processes the cells stayed on their ranks")
        self.rows = {p.config: _row(p) for p in self.ranked}
        self.measured: dict[Config, Measurement] = {}
        self.settled: set[Config] = set()  # the finalists, measured side by side
        self.fit: Fit | None = None

    def next(self, elapsed: float, budget_s: float | None) -> Config | None:
        """The next candidate to run, or None: enough were."""
        tried = [c for c, row in self.rows.items() if row.measured_s or row.error]
        cheap = elapsed < CHEAP_S
        if len(tried) >= (MOST_CHEAP if cheap else MOST_MEASURED):
            return None
        if budget_s is not None and elapsed >= budget_s and self.measured:
            return None
        left = [p.config for p in self.ranked if p.config not in tried]
        if not left:
            return None
        if len(tried) >= FIRST_MEASURED and self.defaults in left:
            return self.defaults  # so that "auto" measured no slower than leaving it out
        if not self.priced:
            return left[0]
        if len(tried) < FIRST_MEASURED or not self.measured:
            # gf.plan's best of another cut and micro-batch count than those run: steps
            # that differ in more than their checkpointing calibrate it better.
            seen = {(c.cut, c.chunks) for c in tried}
            return next((c for c in left if (c.cut, c.chunks) not in seen), left[0])
        self.fit = self._fit()
        guesses = {config: self.pricing.calibrated(config, self.fit) for config in left}
        best = min(m.seconds for m in self.measured.values())
        config = min(left, key=lambda c: guesses[c])
        return config if cheap or guesses[config] <= best * WORTH else None

    def record(self, config: Config, measured: Measurement | None,
               error: BaseException | None) -> None:  # fmt: skip
        row = self.rows[config]
        if error is not None:
            row.error = f"{type(error).__name__}: {error}".splitlines()[0][:120]
            self.first_error = self.first_error or error
        if measured is not None:
            row.measured_s = measured.seconds
            self.measured[config] = measured

    def finalists(self) -> tuple[list[Config], int, int]:
        """The measured candidates close to the best, fastest first (FINALISTS at most), the
        rounds they run side by side and the steps of each turn."""
        ranked = sorted(self.measured, key=lambda c: self.measured[c].seconds)
        best = self.measured[ranked[0]].seconds if ranked else 0.0
        close = [c for c in ranked if self.measured[c].seconds <= best * (1 + CLOSE)]
        close = close[:FINALISTS]
        defaults = self.measured.get(self.defaults)
        if defaults is not None and defaults.seconds <= best * (1 + 2 * CLOSE):
            if self.defaults not in close:  # in the last place, or one more
                close[-1 if len(close) == FINALISTS else len(close) :] = [self.defaults]
        turn = measuring.turn_steps(best)
        timed = turn - turn // 2
        wanted = math.ceil(measuring.MIN_TIMED_S / max(best * timed, 1e-9))
        return close, max(FINAL_ROUNDS, min(MOST_FINAL_ROUNDS, wanted)), turn

    def settle(self, finalists: list[Config], seconds: list[float]) -> None:
        """The finalists' steps as they ran side by side."""
        self.settled = set(finalists)
        for config, value in zip(finalists, seconds, strict=True):
            self.measured[config] = self.measured[config].timed_at(value)
            self.rows[config].measured_s = value

    def result(self, key: int, seconds: float) -> Tuning:
        if not self.measured:  # the first candidate's error: the step's own, likely
            assert self.first_error is not None
            raise self.first_error
        choice = self._fastest_or_defaults()
        plan = None
        if self.priced:
            self.fit = self._fit()
            for config, row in self.rows.items():
                row.calibrated_s = self.pricing.calibrated(config, self.fit)
            measured = self.measured[choice]
            handoff = measured.handoff(choice, self.workers)
            plan = self.pricing.measured_plan(
                choice, measured.costs, handoff, measured.call, measured.seconds
            )
        return Tuning(choice=choice, candidates=list(self.rows.values()), plan=plan,
                      seconds=seconds, signature=key, fit=self.fit,
                      measured_steps=measuring.TIMED_STEPS, notes=self.notes)  # fmt: skip

    def _fastest_or_defaults(self) -> Config:
        """The fastest measured, unless the defaults ran beside it within TIE of it."""
        fastest = min(
            self.measured,
            key=lambda c: (self.measured[c].seconds, self.rows[c].predicted_s or math.inf),
        )
        ran_beside = {fastest, self.defaults} <= self.settled
        if fastest == self.defaults or not ran_beside:
            return fastest
        best, defaults = self.measured[fastest].seconds, self.measured[self.defaults].seconds
        if defaults > best * (1 + TIE):
            return fastest
        self.notes.append(
            f"kept the defaults ({defaults * 1e3:.3g} ms a step side by side): {fastest} "
            f"ran {(1 - best / defaults) * 100:.1f}% faster ({best * 1e3:.3g} ms), within "
            f"the {TIE:.0%} a pick must gain"
        )
        return self.defaults

    def _fit(self) -> Fit:
        samples = [
            (self.pricing.profiled_costs(config), m.costs,
             m.handoff(config, self.workers, with_loss=False), m.call)
            for config, m in self.measured.items()
        ]  # fmt: skip
        pooled = fitted(samples)
        ratios: dict[str, list[float]] = {}
        for config, m in self.measured.items():
            guess = self.pricing.calibrated(config, pooled)
            if guess > 0:
                ratios.setdefault(config.cut.schedule, []).append(m.seconds / guess)
        by_kind = {kind: statistics.median(found) for kind, found in ratios.items()}
        return dataclasses.replace(pooled, by_kind=by_kind)


def unpriced(pipe: Any, builder: Builder, the_space: Space) -> list[Priced]:
    """The candidates without gf.plan, in a fixed order: about four micro-batches per cell
    first, then checkpointing from none to all, the kinds as registered; the cuts by
    parameters (gf.pipeline: its first split points) where they are free."""
    current = current_cut(pipe)
    found: list[Priced] = []
    for kind, cells in the_space.kinds:
        cut = current if len(current.balance) == cells else None
        if the_space.free_cut or cut is None:
            cuts = builder.cuts(cells)
            if cuts:
                cut = Cut(kind, (1,) * cells, cuts[0])
            elif cuts is None:
                module = builder.cells_of(current, pipe)
                cut = Cut(kind, tuple(balance_by_params(cells, module)))
        if cut is None:
            continue
        cut = dataclasses.replace(cut, schedule=kind)
        for chunks in the_space.chunks:
            for checkpoint in the_space.checkpoints:
                found.append(Priced(Config(cut, chunks, checkpoint), None))

    def order(priced: Priced) -> tuple[float, int]:
        config = priced.config
        wanted = 4 * len(config.cut.balance)
        modes = list(the_space.checkpoints)
        return abs(math.log2(config.chunks / wanted)), modes.index(config.checkpoint)

    return sorted(found, key=order)


def _row(priced: Priced) -> TunedCandidate:
    predicted = priced.plan.step_time if priced.plan is not None else None
    return TunedCandidate(priced.config, predicted, priced.peak_memory)


install_tuner(tune)

"""What gf.plan measures once and prices any candidate with: layer costs, memory, overheads."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from gpipe_fast.arguments import check_int
from gpipe_fast.balancing.profile import (
    BACKWARD_PER_FORWARD,
    STATISTICS,
    Device,
    LayerProfile,
    Sample,
    check_param_scale,
    layer_costs_by_params,
    layer_output_bytes,
    layer_param_bytes,
    profile_layers,
    resolve_device,
)
from gpipe_fast.device.host import intra_op_threads, threads_per_cell
from gpipe_fast.nn.microbatch import scatter
from gpipe_fast.planning.activations import ActivationProfile, profile_activations
from gpipe_fast.planning.memory import ParamFacts, param_facts
from gpipe_fast.planning.overhead import task_overhead
from gpipe_fast.planning.predict import StageCosts
from gpipe_fast.schedule.registry import placement, schedule_kind


@dataclass
class LayerCosts:
    """Per-layer task costs of one micro-batch size, in the plan's unit."""

    forward: list[float]
    backward: list[float]
    backward_input: list[float]
    backward_weight: list[float]
    total: list[float]  # what the balance evens out

    def stages(self, balance: Sequence[int]) -> list[StageCosts]:
        sums = [
            cell_sums(values, balance)
            for values in (self.forward, self.backward, self.backward_input, self.backward_weight)
        ]
        return [StageCosts(forward=f, backward=b, backward_input=bi, backward_weight=bw)
                for f, b, bi, bw in zip(*sums, strict=True)]  # fmt: skip


def cell_sums(values: Sequence[float], balance: Sequence[int]) -> list[float]:
    sums, start = [], 0
    for size in balance:
        sums.append(float(sum(values[start : start + size])))
        start += size
    return sums


@dataclass
class Planner:
    """The module and sample with what has been measured of them, each thing once: output
    sizes, the activation profile, parameter facts, layer timings per micro-batch size,
    the runtime's overhead per task per schedule."""

    module: nn.Sequential
    sample: Sample
    cells: int
    cost: str
    device: Device | None
    devices: int | None
    warmup: int
    repeats: int
    param_scale: float
    optimizer: str | float | None
    statistic: str = "median"  # of the repeats: "median" or "mean" (see profile.STATISTICS)
    activation_chunks: int = 1  # the activations are profiled on one such micro-batch
    copies: bool = True  # profile copies of the layers (False: the layers themselves)
    _outputs: list[int] | None = None
    _activations: ActivationProfile | None = None
    _params: ParamFacts | None = None
    _times: dict[tuple[int, bool], LayerCosts] = field(default_factory=dict)
    _overheads: dict[str, float] = field(default_factory=dict)

    def output_bytes(self) -> list[int]:
        if self._outputs is None:
            self._outputs = layer_output_bytes(self.module, self.sample, device=self.device,
                                               copies=self.copies)  # fmt: skip
        return self._outputs

    def activations(self) -> ActivationProfile:
        """What autograd saves, on one micro-batch (its bytes scale with the rows): the
        whole sample's forward would hold all of its activations at once."""
        if self._activations is None:
            microbatch = scatter(self.sample, self.activation_chunks)[0]
            # On the cells' threads, like every other pass of a micro-batch gf.plan makes.
            target = resolve_device(self.device, self.module)
            with intra_op_threads(threads_per_cell([target] * self.cells).per_cell):
                self._activations = profile_activations(self.module, microbatch)
        return self._activations

    def params(self) -> ParamFacts:
        if self._params is None:
            self._params = param_facts(self.module, self.optimizer)
        return self._params

    def workers(self, schedule: str) -> int:
        return plan_workers(schedule, self.cells, self.devices)

    def threads(self, schedule: str) -> int | None:
        """The intra-op threads of each CPU cell's worker, as GPipe sets them (None: CUDA
        cells, or OMP_NUM_THREADS set, which GPipe leaves alone)."""
        target = resolve_device(self.device, self.module)
        return threads_per_cell([target] * self.workers(schedule)).per_cell

    def layer_costs(self, chunks: int, schedule: str) -> LayerCosts:
        """Per-layer costs at `chunks` micro-batches: timed at that micro-batch size (each
        size once, the split backward's halves where a schedule needs them), or derived."""
        split = bool(schedule_kind(schedule).split_backward)
        if self.cost != "time":
            return self._derived(chunks)
        rows = micro_rows(self.sample, chunks)
        key = (rows, split)
        if key not in self._times and (rows, True) in self._times:
            key = (rows, True)  # split timings also hold the whole backward
        if key not in self._times:
            self._times[key] = _layer_costs(
                [self._profile(chunks, schedule, split, self.warmup, self.repeats)], self.statistic
            )
        return self._times[key]

    def _profile(self, chunks: int, schedule: str, split: bool, warmup: int,
                 repeats: int) -> LayerProfile:  # fmt: skip
        """Each layer timed on one micro-batch of `chunks`, on the cells' intra-op threads."""
        microbatch = scatter(self.sample, chunks)[0]
        with intra_op_threads(self.threads(schedule)):
            return profile_layers(self.module, microbatch, device=self.device, warmup=warmup,
                                  repeats=repeats, split=split, statistic=self.statistic,
                                  copies=self.copies)  # fmt: skip

    def _derived(self, chunks: int) -> LayerCosts:
        if self.cost == "size":
            scale = check_param_scale(self.param_scale)
            sizes = zip(self.output_bytes(), layer_param_bytes(self.module), strict=True)
            totals = [out + scale * params for out, params in sizes]
        else:
            totals = layer_costs_by_params(self.module)
        forward = [c / chunks for c in totals]
        backward = [BACKWARD_PER_FORWARD * c for c in forward]
        halves = [b / 2 for b in backward]
        return LayerCosts(forward, backward, halves, halves, totals)

    def overhead(self, schedule: str, chunks: int) -> float:
        """The runtime's cost per task (cost="time"), measured once per schedule (at the
        first `chunks` asked for: it is a cost per task, whatever their number)."""
        if self.cost != "time":
            return 0.0
        if schedule not in self._overheads:
            self._overheads[schedule] = task_overhead(
                self.cells, self.workers(schedule), chunks, schedule,
                mean=self.statistic == "mean",
            )  # fmt: skip
        return self._overheads[schedule]


def profile_in_rounds(wanted: Sequence[tuple[Planner, int, str]], rounds: int) -> None:
    """Times the layers of each (planner, chunks, schedule) once per round, for `rounds`
    rounds, and keeps each layer's median over its rounds (what `layer_costs` then returns).
    Profiled one after another, each with its repeats in a row, a layer set's profile took a
    second or two of its own, and a shared host's speed drifts from one second to the next:
    a LLaMA's two cuts (1f1b at 4 micro-batches, interleaved at 2) were priced 0.77 to 1.01 of
    each other over 16 pricings on a quiet host (mean |log| off the median 0.072), 0.49 to
    1.36 with two other processes busy on and off (0.14); in rounds, where every profile
    spans the same seconds, 0.86 to 1.01 (0.027) and 0.62 to 1.22 (0.095). A profile that
    fails is left out (`layer_costs` then raises its error)."""
    pending: dict[tuple[int, int], tuple[Planner, int, str, bool]] = {}
    for planner, chunks, schedule in wanted:
        if planner.cost != "time":
            continue
        rows = micro_rows(planner.sample, chunks)
        split = bool(schedule_kind(schedule).split_backward)
        key = (id(planner._times), rows)  # planners of the same layers share their times
        if any(k in planner._times for k in ((rows, True), (rows, split))):
            continue
        if key in pending:
            split = split or pending[key][3]
        pending[key] = (planner, chunks, schedule, split)
    samples: dict[tuple[int, int], list[LayerProfile]] = {key: [] for key in pending}
    for round_index in range(rounds):
        for key, (planner, chunks, schedule, split) in pending.items():
            if key not in samples:
                continue
            warmup = planner.warmup if round_index == 0 else 0
            try:
                samples[key].append(planner._profile(chunks, schedule, split, warmup, 1))
            except (RuntimeError, ValueError):
                del samples[key]
    for key, found in samples.items():
        planner, _, _, split = pending[key]
        rows = key[1]
        planner._times[(rows, split)] = _layer_costs(found, planner.statistic)


def _layer_costs(profiles: Sequence[LayerProfile], statistic: str) -> LayerCosts:
    """The layers' costs over `profiles` of the same layers (each layer's `statistic` over
    them), a backward not timed in halves taken as two equal ones."""
    average = STATISTICS[statistic]

    def each(values: list[list[float]]) -> list[float]:
        return [average(list(layer)) for layer in zip(*values, strict=True)]

    forward = each([p.forward for p in profiles])
    backward = each([p.backward for p in profiles])
    split = [p for p in profiles if p.backward_input]
    halves = [b / 2 for b in backward]
    backward_input = each([p.backward_input for p in split]) if split else halves
    backward_weight = each([p.backward_weight for p in split]) if split else halves
    total = [f + b for f, b in zip(forward, backward, strict=True)]
    return LayerCosts(forward, backward, backward_input, backward_weight, total)


def micro_rows(sample: Sample, chunks: int) -> int:
    """Rows of the largest micro-batch of `sample` split into `chunks`."""
    tensors = sample if isinstance(sample, tuple) else (sample,)
    return math.ceil(min(t.size(0) for t in tensors) / chunks)


def plan_workers(schedule: str, cells: int, devices: object) -> int:
    """The workers (devices) the cells share: `devices`, or by default as many as the kind
    runs `cells` cells on (one per cell; cells / 2 for zbv); checked against the kind's rule,
    ValueError naming the argument that does not fit."""
    per = schedule_kind(schedule).stages_per_worker
    if devices is None:
        workers, argument = max(1, cells // per) if per else cells, "partitions"
    else:
        workers, argument = check_int(devices, "devices", 1), "devices"
    try:
        placement(schedule, cells, workers)
    except ValueError as error:
        raise ValueError(f"{argument}: {error}") from None
    return workers

"""Predicted memory of a train_step: per cell, per worker and on one shared device.

At rest a cell holds its parameters and the optimizer's state; its gradients appear at its
first backward (``optimizer.zero_grad()`` sets them to None, torch's default). On top, each
micro-batch in flight holds what its forward kept for the backward (the cell's input and
what autograd saved; only the input when the micro-batch is checkpointed, until its
recompute), for as long as the schedule's program keeps it: from the forward to the backward
(split backwards: to the weight half, with every layer's output, as the layers then run one
by one, and from the input half on the output gradients of the learning layers), and a
running task needs its largest layer's input and output beside it. The program is walked in
the order the simulator runs it."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from gpipe_fast import _C
from gpipe_fast.planning.activations import ActivationProfile

# Copies of every parameter an optimizer keeps, by name (AdamW: the two moments).
OPTIMIZER_COPIES = {"adamw": 2.0, "adam": 2.0, "sgd": 0.0}
# Temporaries of one parameter's size its step makes (torch's AdamW on CPU, one tensor at a
# time: the second moment's square root, then that divided by its bias correction).
OPTIMIZER_WORK = {"adamw": 2, "adam": 2, "sgd": 0}
# The actions that compute on a cell's layers (the rest, the loss and communication, are
# taken to hold nothing of note).
_COMPUTE = frozenset({"forward", "recompute", "backward", "backward_input", "backward_weight"})
# The actions that make weight gradients.
_WEIGHTS = frozenset({"backward", "backward_weight"})


@dataclass(frozen=True)
class CellMemory:
    """Bytes of one cell, per device it runs on (per rank with data parallelism)."""

    params: int
    grads: int
    optimizer: int
    activations: int  # the most the cell's micro-batches hold at once, running task included
    peak: int  # params + optimizer + batch + the most of gradients and activations together
    batch: int = 0  # the first cell's: the whole input mini-batch (its micro-batches are views)


@dataclass(frozen=True)
class MemoryPrediction:
    cells: list[CellMemory]
    workers: list[int]  # peak bytes of each worker's cells together (one device each)
    one_device: int  # peak bytes of all cells on one device (CPU cells of one process)


@dataclass(frozen=True)
class ParamFacts:
    """Per layer: parameter bytes, bytes of those that learn, optimizer state bytes, and the
    largest learning parameter's bytes (a backward makes its gradient, then adds it to
    ``.grad``; the optimizer's step makes temporaries of its size)."""

    params: list[int]
    grads: list[int]
    optimizer: list[int]
    largest: list[int]
    optimizer_work: int  # temporaries per parameter, in parameter sizes


def check_optimizer(optimizer: object) -> str | float | None:
    """None, a name of OPTIMIZER_COPIES, or bytes per parameter element (a number >= 0)."""
    if optimizer is None or (isinstance(optimizer, str) and optimizer in OPTIMIZER_COPIES):
        return optimizer
    if isinstance(optimizer, numbers.Real) and not isinstance(optimizer, bool):
        value = float(optimizer)
        if math.isfinite(value) and value >= 0:
            return value
    raise ValueError(
        f"optimizer must be None, one of {tuple(OPTIMIZER_COPIES)} or bytes per parameter "
        f"(a number >= 0), got {optimizer!r}"
    )


def param_facts(module: nn.Sequential, optimizer: str | float | None) -> ParamFacts:
    params, grads, state, largest = [], [], [], []
    for layer in module:
        tensors = list(layer.parameters())
        size = sum(p.numel() * p.element_size() for p in tensors)
        learning = sum(p.numel() * p.element_size() for p in tensors if p.requires_grad)
        if isinstance(optimizer, float):
            kept = math.ceil(optimizer * sum(p.numel() for p in tensors if p.requires_grad))
        else:
            kept = math.ceil(OPTIMIZER_COPIES.get(optimizer or "sgd", 0.0) * learning)
        params.append(size)
        grads.append(learning)
        state.append(kept)
        sizes = [p.numel() * p.element_size() for p in tensors if p.requires_grad]
        largest.append(max(sizes, default=0))
    work = OPTIMIZER_WORK.get(optimizer, 0) if isinstance(optimizer, str) else 0
    return ParamFacts(params, grads, state, largest, work)


@dataclass(frozen=True)
class _Stage:
    """One cell's facts for the walk."""

    kept: frozenset[int]  # storages held per micro-batch without checkpointing
    stash: frozenset[int]  # held per checkpointed micro-batch (the cell's input)
    working: int
    weight_work: int  # a weight gradient made before it is added to `.grad`
    pending: int  # output gradients kept from a split backward's input half to its weights'
    incoming: int  # the gradient of the cell's output, from the next cell's backward to its own
    grads: int  # gradient bytes that appear at the cell's first backward
    step_work: int  # the optimizer step's temporaries
    rest: int  # parameters, optimizer state and the input batch
    params: int
    optimizer: int
    batch: int


def predict_memory(
    schedule: _C.Schedule,
    starts: Sequence[float],
    ends: Sequence[float],
    balance: Sequence[int],
    rows: int,
    activations: ActivationProfile,
    facts: ParamFacts,
    *,
    batch_rows: int,
    dp: int = 1,
    dp_shard: bool = False,
) -> MemoryPrediction:
    """Walks `schedule`'s tasks in the simulated order (`starts`, `ends`) for micro-batches of
    `rows` rows, out of a mini-batch of `batch_rows`. With `dp_shard`, parameters, gradients
    and optimizer state are 1/dp each at rest, plus the cell's largest layer whole (its
    parameters and gradients) while it runs."""
    names = _C.actions()
    split = any(names[task.action] == "backward_input" for task in schedule.tasks)
    shards = dp if dp_shard else 1
    stages = _stages(balance, (rows, batch_rows), activations, facts, shards, split)
    sizes = {k: activations.bytes_of((k,), rows) for k in range(len(activations.storage_bytes))}
    flags = [list(f) for f in _C.recomputed(schedule)]
    walk = _Walk(schedule, starts, ends, stages, sizes, flags)
    on = schedule.stage_workers
    cells = [frozenset({k}) for k in range(len(stages))]
    workers = [frozenset(k for k in range(len(stages)) if on[k] == w)
               for w in range(schedule.workers)]  # fmt: skip
    everything = frozenset(range(len(stages)))
    groups = list(dict.fromkeys([*cells, *workers, everything]))  # each set walked once
    peaks = dict(zip(groups, walk.peaks(groups), strict=True))
    return MemoryPrediction(
        [CellMemory(stage.params, stage.grads, stage.optimizer, peaks[cell][0],
                    _peak(peaks[cell][1], stages, cell), stage.batch)
         for stage, cell in zip(stages, cells, strict=True)],
        [_peak(peaks[group][1], stages, group) for group in workers],
        _peak(peaks[everything][1], stages, everything),
    )  # fmt: skip


def _peak(step: int, stages: list[_Stage], chosen: frozenset[int]) -> int:
    """Peak bytes of the `chosen` stages on one device: at rest, plus `step` (the most of the
    step's gradients and activations at once), or all gradients and the optimizer step's
    temporaries (one parameter at a time), whichever is more."""
    if not chosen:
        return 0
    rest = sum(stages[k].rest for k in chosen)
    optimizer = sum(stages[k].grads for k in chosen) + max(stages[k].step_work for k in chosen)
    return rest + max(step, optimizer)


def _stages(
    balance: Sequence[int],
    sizes: tuple[int, int],  # rows of a micro-batch, of the mini-batch
    act: ActivationProfile,
    facts: ParamFacts,
    shards: int,
    split: bool,
) -> list[_Stage]:
    stages, start = [], 0
    rows, batch_rows = sizes
    for size in balance:
        layers = range(start, start + size)
        params = sum(facts.params[i] for i in layers)
        grads = sum(facts.grads[i] for i in layers)
        optimizer = sum(facts.optimizer[i] for i in layers)
        if shards > 1:
            # One FSDP unit, the largest layer, is gathered whole while it runs.
            unit = max(layers, key=lambda i: facts.params[i])
            params = math.ceil(params / shards) + facts.params[unit]
            grads = math.ceil(grads / shards) + facts.grads[unit]
            optimizer = math.ceil(optimizer / shards)
        largest = max(facts.largest[i] for i in layers)
        kept, stash, batch = act.kept(layers, split), act.inputs[layers.start], 0
        # A split backward keeps each learning layer's output gradient from its input half
        # to its weight half.
        roots = [i for i in layers if facts.grads[i]] if split else []
        pending = sum(act.bytes_of(act.outputs[i], rows) for i in roots)
        if start == 0:
            # The first cell's micro-batches are views of the caller's input, which holds
            # the whole mini-batch for the step whatever is in flight.
            batch = act.bytes_of(stash, batch_rows)
            kept, stash = kept - stash, frozenset()
        incoming = act.bytes_of(act.outputs[layers.stop - 1], rows)
        stages.append(_Stage(kept, stash, act.working(layers, rows), largest, pending, incoming,
                             grads,
                             facts.optimizer_work * largest, params + optimizer + batch,
                             params, optimizer, batch))  # fmt: skip
        start += size
    return stages


class _Group:
    """The running bytes of a group of stages on one device."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, int], int] = {}  # holders of each (storage, micro-batch)
        self.held = self.working = self.grads = 0
        self.most_held = self.most = 0

    def start(self, work: int, taken: int, grads: int) -> None:
        self.working += work
        self.held += taken
        self.grads += grads
        self.most_held = max(self.most_held, self.held + self.working)
        self.most = max(self.most, self.held + self.working + self.grads)

    def end(self, work: int, given: int) -> None:
        self.working -= work
        self.held -= given


class _Walk:
    """The schedule's tasks as events in simulated time: a task takes what it holds at its
    start (and its working memory until its end); a backward gives its micro-batch's back at
    its end."""

    def __init__(
        self,
        schedule: _C.Schedule,
        starts: Sequence[float],
        ends: Sequence[float],
        stages: list[_Stage],
        sizes: dict[int, int],
        flags: list[list[bool]],
    ) -> None:
        self.tasks = list(schedule.tasks)
        names = _C.actions()
        self.actions = [names[t.action] for t in self.tasks]
        self.stages, self.sizes, self.flags = stages, sizes, flags
        events = []
        for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
            events.append((start, 1, i))
            events.append((end, 0 if end > start else 2, i))  # an instant task ends after
        self.events = sorted(events)

    def peaks(self, groups: list[frozenset[int]]) -> list[tuple[int, int]]:
        """For each group of stages on one device: (most activation bytes, most activation
        and gradient bytes) at once, in one pass over the events."""
        member: list[list[_Group]] = [[] for _ in self.stages]
        walks = [_Group() for _ in groups]
        for group, walk in zip(groups, walks, strict=True):
            for k in group:
                member[k].append(walk)
        holds: dict[tuple[int, int], frozenset[int]] = {}
        graded: set[int] = set()
        for _, edge, i in self.events:
            task, action = self.tasks[i], self.actions[i]
            if action not in _COMPUTE:
                continue
            k, m = task.stage, task.microbatch
            stage = self.stages[k]
            work = stage.working + (stage.weight_work if action in _WEIGHTS else 0)
            if edge == 1:  # the task starts
                new: frozenset[int] = frozenset()
                if action in ("forward", "recompute"):
                    checkpointed = self.flags[k][m] and action == "forward"
                    wanted = stage.stash if checkpointed else stage.kept
                    new = wanted - holds.get((k, m), frozenset())
                    holds[(k, m)] = wanted | holds.get((k, m), frozenset())
                taken = stage.pending if action == "backward_input" else 0
                grads = 0
                if action in _WEIGHTS and k not in graded:
                    graded.add(k)
                    grads = stage.grads
                for walk in member[k]:
                    walk.start(work, taken + self._count(walk.counts, new, m, 1), grads)
            else:
                gone = holds.pop((k, m), frozenset()) if action in _WEIGHTS else frozenset()
                given = stage.pending if action == "backward_weight" else 0
                if action in ("backward", "backward_input"):
                    # It consumed its output's gradient and handed its input's to the cell
                    # before, which holds it until its own backward.
                    given += stage.incoming if k + 1 < len(self.stages) else 0
                    for walk in member[k - 1] if k > 0 else []:
                        walk.start(0, self.stages[k - 1].incoming, 0)
                for walk in member[k]:
                    walk.end(work, given + self._count(walk.counts, gone, m, -1))
        return [(walk.most_held, walk.most) for walk in walks]

    def _count(
        self, counts: dict[tuple[int, int], int], keys: frozenset[int], m: int, delta: int
    ) -> int:
        """Bytes that start (delta 1) or stop (delta -1) being held by anyone."""
        changed = 0
        for key in keys:
            before = counts.get((key, m), 0)
            counts[(key, m)] = before + delta
            if (before == 0) != (before + delta == 0):
                changed += self.sizes[key]
        return changed

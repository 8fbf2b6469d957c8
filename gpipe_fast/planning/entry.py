"""gf.plan: its arguments checked, then one plan evaluated, calibrated, or searched for."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from gpipe_fast.arguments import check_balance, check_choice, check_count, check_module
from gpipe_fast.balancing.profile import STATISTICS, Device, Sample
from gpipe_fast.nn.microbatch import as_tensors
from gpipe_fast.planning.candidates import Choice
from gpipe_fast.planning.memory import check_optimizer
from gpipe_fast.planning.plan import PLAN_COSTS, Plan, calibrated_plan, evaluate, fitted_plan
from gpipe_fast.planning.planner import Planner
from gpipe_fast.planning.search import choose
from gpipe_fast.planning.tuning import Tuning
from gpipe_fast.runtime.timeline import Timeline


def _first_dim(tensors: Sequence[Tensor]) -> int:
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("sample must have a batch dimension (dim 0) on every tensor")
    return min(t.size(0) for t in tensors)


def plan(
    module: nn.Sequential,
    sample: Sample,
    partitions: int,
    chunks: int | None = None,
    *,
    balance: Sequence[int] | None = None,
    cost: str = "time",
    device: Device | None = None,
    checkpoint: str | None = "never",
    schedule: str | None = "gpipe",
    devices: int | None = None,
    warmup: int = 2,
    repeats: int = 5,
    param_scale: float = 2.0,
    calibrate: Timeline | Sequence[Timeline] | Tuning | None = None,
    optimizer: str | float | None = None,
    dp: int = 1,
    dp_shard: bool | None = None,
    memory_per_device: int | None = None,
    statistic: str = "median",
) -> Plan:
    """Balances `module` into `partitions` cells by `cost` ("time", "size" or "params"; or takes
    the given `balance`) and predicts a training step of `schedule` on `sample`, a whole
    mini-batch that is split into `chunks` micro-batches: its time and its memory. `devices`:
    how many devices (workers) the cells share, for the interleaved schedule (default: as the
    schedule places them: one per cell, two for zbv).

    With cost="time" each layer is timed as its cell will run it: on one micro-batch of the
    sample, on `device`, with the intra-op threads each CPU cell's worker gets (the cores
    shared by the CPU cells, as GPipe does); the zero-bubble schedule's backward halves are
    timed apart. The runtime's own cost per task (its hand-offs and Python work, measured by
    a step through cells that do nothing) is added to every task. The other costs stand for
    a layer's forward, its backward is taken as BACKWARD_PER_FORWARD times that, split in
    equal halves for zero bubble, and a task costs its cell's cost / chunks. `statistic`:
    how the timed repeats (of each layer, and of the overhead's steps) are summed up:
    "median" (default: the odd slow run left out) or "mean" (stalls counted at their rate:
    a step adds them up, which on a busy shared host the median misses).

    Memory (``plan.memory`` per cell, ``plan.peak_memory`` per device): parameters,
    gradients, the optimizer's state (`optimizer`: "adamw", "adam", "sgd", None, or bytes
    per parameter element) and the activations each micro-batch keeps while the schedule
    holds it, by what autograd saves in one forward of the sample (see planning/memory.py).
    `dp` ranks with `dp_shard=True` hold 1/dp of parameters, gradients and optimizer state,
    plus the largest layer whole (None: not sharded, or both tried under a budget). The
    sample is one rank's batch.

    `memory_per_device` (bytes): gf.plan chooses. `chunks`, `checkpoint`, `schedule` and
    `dp_shard` left None are searched (chunks among the divisors and powers of two up to the
    batch, every checkpoint mode, every registered schedule that runs on the devices, sharded
    or not when dp > 1), with the balance of the cost and one evening out memory, and the
    fastest plan whose peak fits is returned (ties: the least memory); ValueError naming the
    smallest peak when none fits. Layers are timed once per micro-batch size, every size's
    `repeats` in rounds (each size once a round), so that a drifting host's speed weighs on
    every candidate alike.

    `calibrate`: one or more timelines of steps recorded with `balance` (``pipe.timeline()``
    after ``pipe.record_timeline()``), of any schedule with the same cells and chunks. Each
    cell's task costs are then the recorded tasks' medians, the overhead per task is what
    the recorded step spent between its tasks, solved through the simulator, and what a
    train_step call spent around its tasks is added once (`call_overhead`); nothing is
    timed. It predicts another `schedule` from the step as it ran on this machine. Or
    `calibrate=pipe.tuning` (a pipe's :class:`~gpipe_fast.Tuning`): the layers are timed as
    without it, then scaled, and the hand-off per task and the call's own seconds taken, as
    the steps the tuning measured fitted them (``tuning.fit``, with its correction of the
    schedule kind where the tuning ran that kind), for any balance, chunks, checkpoint and
    schedule.
    """
    module = check_module(module)
    cells = check_count(partitions, "partitions", len(module))
    cost = check_choice(cost, "cost", PLAN_COSTS)
    choice = Choice.check(chunks, checkpoint, schedule, dp, dp_shard, memory_per_device)
    if balance is not None:
        balance = check_balance(balance, len(module), cells=cells)
    batch = _first_dim(as_tensors(sample, "sample"))
    if choice.chunks is not None and choice.chunks > batch:
        raise ValueError(f"chunks ({chunks}) must not exceed the sample's batch size ({batch})")
    planner = Planner(module, sample, cells, cost, device, devices, warmup, repeats,
                      param_scale, check_optimizer(optimizer),
                      check_choice(statistic, "statistic", tuple(STATISTICS)),
                      choice.chunks or 1)  # fmt: skip
    if isinstance(calibrate, Tuning):
        fit = calibrate.fit
        if fit is None:
            raise ValueError("calibrate: this tuning measured nothing gf.plan could price")
        if planner.cost != "time":
            raise ValueError(f"calibrate: calibrating measures time, got cost={cost!r}")
        candidate = choice.only()
        fit = fit.of_kind(candidate.schedule)
        return fitted_plan(planner, balance, candidate, fit.scale, fit.handoff, fit.call)
    if calibrate is not None:
        return calibrated_plan(planner, balance, choice, calibrate)
    if memory_per_device is None:
        return evaluate(planner, balance, choice.only())
    return choose(planner, balance, choice, batch)

"""gf.plan under a memory budget: the fastest predicted plan whose peak fits."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from gpipe_fast.balancing.balance import partition
from gpipe_fast.planning.candidates import CHECKPOINTS, Candidate, Choice
from gpipe_fast.planning.plan import Plan, evaluate
from gpipe_fast.planning.planner import Planner, micro_rows, profile_in_rounds
from gpipe_fast.schedule.registry import schedules


def chunk_counts(batch: int) -> list[int]:
    """The micro-batch counts tried: the batch's divisors and the powers of two up to it."""
    divisors = {d for d in range(1, batch + 1) if batch % d == 0}
    powers = {1 << i for i in range(batch.bit_length()) if 1 << i <= batch}
    return sorted(divisors | powers)


def runnable_schedules(planner: Planner) -> list[str]:
    """The registered schedules that place the cells on the devices."""
    runnable = []
    for schedule in schedules():
        try:
            planner.workers(schedule)
        except ValueError:
            continue
        runnable.append(schedule)
    return runnable


def candidates(planner: Planner, choice: Choice, batch: int) -> Iterator[Candidate]:
    chunks = [choice.chunks] if choice.chunks else chunk_counts(batch)
    modes = [choice.checkpoint] if choice.checkpoint else list(CHECKPOINTS)
    schedules = [choice.schedule] if choice.schedule else runnable_schedules(planner)
    if choice.dp_shard is not None:
        shards = [choice.dp_shard]
    else:
        shards = [False, True] if choice.dp > 1 else [False]
    for m, mode, schedule, shard in itertools.product(chunks, modes, schedules, shards):
        yield Candidate(m, mode, schedule, choice.dp, shard)


def memory_balance(planner: Planner, chunks: int) -> list[int]:
    """A balance evening out what each layer holds in a fill-drain step of `chunks`
    micro-batches: its parameters, gradients and optimizer state, and what its forward
    saves for each micro-batch."""
    act, facts = planner.activations(), planner.params()
    rows = micro_rows(planner.sample, chunks)
    costs = [
        facts.params[i] + facts.grads[i] + facts.optimizer[i]
        + chunks * act.bytes_of(act.saved[i] | act.inputs[i], rows)
        for i in range(len(planner.module))
    ]  # fmt: skip
    return partition([float(c) + 1.0 for c in costs], planner.cells)


def choose(planner: Planner, balance: Sequence[int] | None, choice: Choice, batch: int) -> Plan:
    """The fastest plan by its prediction whose peak memory per device fits the budget
    (ties: the least memory); ValueError naming the smallest peak when none does."""
    budget = choice.budget
    assert budget is not None
    best: Plan | None = None
    smallest: Plan | None = None
    found = list(candidates(planner, choice, batch))
    # Every micro-batch size the candidates price, timed together in rounds: one after
    # another, each size's profile would span its own seconds of a drifting host's speed,
    # and the ranking would compare the seconds, not the candidates.
    profile_in_rounds([(planner, c.chunks, c.schedule) for c in found], planner.repeats)
    for candidate in found:
        for option in _balances(planner, balance, candidate):
            plan = evaluate(planner, option, candidate)
            if smallest is None or plan.peak_memory < smallest.peak_memory:
                smallest = plan
            if plan.peak_memory <= budget and (best is None or _key(plan) < _key(best)):
                best = plan
    if best is None:
        assert smallest is not None
        raise ValueError(
            f"memory_per_device: no plan fits {budget} bytes; the smallest predicted peak is "
            f"{smallest.peak_memory} bytes (balance {smallest.balance}, chunks "
            f"{smallest.chunks}, checkpoint {smallest.checkpoint!r}, schedule "
            f"{smallest.schedule!r}{', dp_shard' if smallest.dp_shard else ''})"
        )
    return best


def _balances(
    planner: Planner, balance: Sequence[int] | None, candidate: Candidate
) -> list[Sequence[int]]:
    """The given balance, or the cost's and the memory's (once when they agree)."""
    if balance is not None:
        return [balance]
    costs = planner.layer_costs(candidate.chunks, candidate.schedule)
    options: list[Sequence[int]] = [partition(costs.total, planner.cells)]
    by_memory = memory_balance(planner, candidate.chunks)
    return options if by_memory == options[0] else [*options, by_memory]


def _key(plan: Plan) -> tuple[float, int]:
    return (plan.step_time, plan.peak_memory)

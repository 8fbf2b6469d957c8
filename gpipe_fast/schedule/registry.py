"""Schedules by name: the native registry of kinds and actions, as Python sees it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from gpipe_fast import _C

# The schedule kinds, in the native registry's order (a fixed table: see kinds.cpp).
SCHEDULES: tuple[str, ...] = tuple(kind.name for kind in _C.schedule_kinds())


def check_schedule(schedule: object) -> str:
    if isinstance(schedule, str) and schedule in SCHEDULES:
        return str(schedule)
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def schedule_kind(schedule: str) -> Any:
    """The kind's facts: name, stages_per_worker (0: any number), split_backward, summary."""
    return _C.schedule_kind(schedule)


def actions() -> list[str]:
    """Every action's name, indexed by its id, as registered now: actions may be added after
    import (register_action), so each step looks them up anew."""
    return _C.actions()


def communication_actions() -> frozenset[str]:
    """The actions that run on communication workers (sends, receives, reductions), as
    registered now: not the compute a bubble is measured against."""
    return frozenset(fact.name for fact in _C.action_facts() if fact.communication)


def placement(schedule: str, cells: int, workers: int) -> list[int]:
    """The worker of each cell under `schedule`: the kind's placement rule (ValueError when
    it cannot run `cells` cells on `workers` workers)."""
    return list(_C.placement(schedule, cells, workers))


def ideal_bubble(schedule: str, cells: int, workers: int, microbatches: int) -> float:
    """The kind's training-step bubble with equal cells and no overheads, simulated."""
    return float(_C.ideal_bubble(schedule, cells, workers, microbatches))


def recomputed(schedule: Any) -> list[list[bool]]:
    """Which (stage, micro-batch) the schedule recomputes: flags[stage][micro-batch]."""
    return [list(flags) for flags in _C.recomputed(schedule)]


class Need(NamedTuple):
    """One prerequisite of a registered action: the first of `any_of`, each (action, stage
    offset), that a schedule holds, on the task's own micro-batch ("same") or one per
    micro-batch of the step ("every"); alternatives off the pipeline's ends are left out."""

    any_of: list[tuple[str, int]]
    microbatches: str = "same"
    required: bool = True


def register_action(
    name: str, needs: Sequence[Need], *, communication: bool = False, cost: str = "none"
) -> int:
    """Adds an action for good (its tasks call ``Stage.<name>(micro_batch)``) and returns its
    id; `cost` is what the simulator prices it as ("forward", "backward", ... or "none")."""
    rules = [(n.any_of, n.microbatches, n.required) for n in needs]
    return int(_C.register_action(name, rules, communication, cost))

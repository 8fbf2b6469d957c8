"""Schedules by name: the native registry of kinds and actions, as Python sees it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from gpipe_fast import _C

# A program as a generator returns it: per worker, its (action, stage, micro-batch) in order.
Program = Sequence[Sequence[tuple[str, int, int]]]
Generator = Callable[[int, int, int], Program]
Placement = Callable[[int, int, int], int]
# What a task of an action does: handler(stage, micro_batch), on the stage's worker; `stage`
# is a gpipe_fast.runtime.stage.Stage (a higher layer than this module's, hence Any).
Handler = Callable[[Any, int], None]


def schedules() -> tuple[str, ...]:
    """Every schedule kind's name, in the native registry's order, as registered now."""
    return tuple(kind.name for kind in _C.schedule_kinds())


def builtin_schedules() -> tuple[str, ...]:
    """The kinds built into the native core (not registered at run time)."""
    return tuple(kind.name for kind in _C.schedule_kinds() if not kind.registered)


def check_schedule(schedule: object) -> str:
    known = schedules()
    if isinstance(schedule, str) and schedule in known:
        return str(schedule)
    raise ValueError(f"schedule must be one of {known}, got {schedule!r}")


def register_schedule_kind(
    name: str,
    generator: Generator,
    *,
    placement: str | Placement = "round_robin",
    stages_per_worker: int = 1,
    split_backward: bool = False,
    summary: str = "",
) -> None:
    """Adds a schedule kind: ``generator(stages, workers, microbatches)`` returns, per worker,
    its ordered list of (action, stage, micro-batch), without recomputes (checkpointing adds
    them). It then runs as a built-in kind does (``GPipe(..., schedule=name)``, across
    processes, evaluation's forward-only run, the simulator): its programs are linked and
    dry-run as they are made (ValueError naming the kind). `placement`: "round_robin" (stage s
    on worker s mod W), "zigzag" (ZB-V's V) or ``placement(stage, stages, workers) ->
    worker``; `stages_per_worker` 0 means any number (stages a multiple of the workers);
    `split_backward`: backward runs as backward_input then backward_weight. Every process of
    a pipe must register it. ValueError if `name` is taken."""
    if not isinstance(stages_per_worker, int) or isinstance(stages_per_worker, bool):
        raise TypeError(f"stages_per_worker must be an int, got {stages_per_worker!r}")
    _C.register_schedule_kind(
        name, generator, placement, stages_per_worker, bool(split_backward), summary
    )


def unregister_schedule_kind(name: str) -> None:
    """Removes a kind added by register_schedule_kind (ValueError for a built-in one); a pipe
    built with it keeps the schedules it has made, but can make no new one (another number
    of micro-batches) once it is gone."""
    _C.unregister_schedule_kind(name)


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


# Each action's handler by name: the built-in actions' Stage methods (runtime/actions.py)
# and those registered with one.
_HANDLERS: dict[str, Handler] = {}


def register_action(
    name: str,
    needs: Sequence[Need],
    *,
    communication: bool = False,
    cost: str = "none",
    handler: Handler | None = None,
) -> int:
    """Adds an action for good and returns its id: its tasks call ``handler(stage,
    micro_batch)`` (none: a step running one raises NotImplementedError naming it); `cost` is
    what the simulator prices it as ("forward", "backward", ... or "none"). Every process of a
    pipe must register it alike."""
    if handler is not None and not callable(handler):
        raise ValueError(f"action {name!r}: handler must be callable, got {handler!r}")
    rules = [(n.any_of, n.microbatches, n.required) for n in needs]
    action = int(_C.register_action(name, rules, communication, cost))
    if handler is not None:
        _HANDLERS[name] = handler
    return action


def set_handler(name: str, handler: Handler) -> None:
    """Makes `handler` run the tasks of the registered action `name` (ValueError if none)."""
    if name not in actions():
        raise ValueError(f"unknown action {name!r}: register it first (register_action)")
    _HANDLERS[name] = handler


def action_handler(name: str) -> Handler | None:
    """The handler of action `name`, or None when it has none."""
    return _HANDLERS.get(name)


def receiving_actions() -> dict[str, str]:
    """The actions that receive an activation or a gradient from another process, with the
    message each receives (the registry's facts, as registered now)."""
    return {
        fact.name: fact.receives
        for fact in _C.action_facts()
        if fact.receives in ("activation", "gradient")
    }


def one_way_actions(direction: str) -> frozenset[str]:
    """The actions that only send ("send") or only receive ("receive") a message between
    processes, as registered now (a reduction does both, and is neither)."""
    facts = _C.action_facts()
    if direction == "send":
        return frozenset(f.name for f in facts if f.sends != "none" and f.receives == "none")
    if direction == "receive":
        return frozenset(f.name for f in facts if f.receives != "none" and f.sends == "none")
    raise ValueError(f"direction must be 'send' or 'receive', got {direction!r}")

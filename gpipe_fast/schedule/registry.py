"""Training-step schedules by name: the native generators, built and validated once per layout."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
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


class ScheduleCache:
    """The schedules of one pipe (its stages and their workers), each built and validated
    once per (kind, micro-batches, checkpoint) and kept while recently used.

    With `worker_ranks` (the rank of each compute worker; stages placed by the kind) or
    `reduce_grad`, a training step is lowered onto ranks: this process (`rank`) runs its
    compute workers and one communication worker for the sends, receives and gradient
    reductions; every rank's program is dry-run together once when the schedule is built."""

    def __init__(
        self,
        stage_workers: Sequence[int],
        kind: str,
        *,
        worker_ranks: Sequence[int] | None = None,
        rank: int = 0,
        reduce_grad: bool = False,
        capacity: int = 64,
    ) -> None:
        self.stage_workers = list(stage_workers)
        self.stages = len(self.stage_workers)
        self.workers = max(self.stage_workers) + 1
        self.kind = kind
        self.lowered = worker_ranks is not None or reduce_grad
        self.worker_ranks = list(worker_ranks) if worker_ranks is not None else [0] * self.workers
        self.rank = rank
        self.reduce_grad = reduce_grad
        self.capacity = capacity
        self._built: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

    def _get(self, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
        found = self._built.get(key)
        if found is None:
            found = self._built[key] = build()
            if len(self._built) > self.capacity:
                self._built.popitem(last=False)
        else:
            self._built.move_to_end(key)
        return found

    def train_step(self, microbatches: int, checkpoint: str) -> tuple[Any, list[list[bool]]]:
        """The training-step schedule and its recompute flags."""

        def build() -> tuple[Any, list[list[bool]]]:
            if self.lowered:
                schedule = _C.rank_schedule(
                    self.kind, self.stages, self.workers, microbatches, checkpoint,
                    self.worker_ranks, self.reduce_grad, self.rank,
                )  # fmt: skip
            else:
                schedule = _C.make_schedule(
                    self.kind, self.stages, self.workers, microbatches, checkpoint
                )
            return schedule, recomputed(schedule)

        return self._get(("step", microbatches, checkpoint), build)  # type: ignore[no-any-return]

    def forward_only(self, microbatches: int, *, loss: bool) -> Any:
        """The forward-only run of an evaluation: eval_step (with `loss`) or pipe(x) under
        no_grad across processes (without): the kind's forwards, lowered like its training
        step when that is lowered."""

        def build() -> Any:
            if self.lowered:
                return _C.rank_forward_schedule(
                    self.kind, self.stages, self.workers, microbatches, loss,
                    self.worker_ranks, self.rank,
                )  # fmt: skip
            return _C.forward_schedule(self.kind, self.stages, self.workers, microbatches, loss)

        return self._get(("forward_only", microbatches, loss), build)

    def forward(self, microbatches: int) -> Any:
        """The fill-drain forward run of pipe(x). A lowered pipe's executor also has
        communication workers, so it runs the lowered forward-only schedule (in one process,
        with dp_group alone, they stay idle)."""
        if self.lowered:
            return self.forward_only(microbatches, loss=False)
        return self._get(
            ("forward", microbatches),
            lambda: _C.gpipe_forward(self.stages, microbatches, self.stage_workers),
        )

    def backward(self, recompute: tuple[bool, ...]) -> Any:
        """The fill-drain backward run of loss.backward(), recomputing where flagged."""
        return self._get(
            ("backward", recompute),
            lambda: _C.gpipe_backward(
                self.stages, len(recompute), list(recompute), self.stage_workers
            ),
        )

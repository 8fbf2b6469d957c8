"""The schedules of one pipe, each built and validated once and kept while recently used."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from gpipe_fast import _C
from gpipe_fast.schedule.registry import recomputed


class ScheduleCache:
    """The schedules of one pipe (its stages and their workers), each built and validated
    once per (kind, micro-batches, checkpoint) and kept while recently used.

    With `worker_ranks` (the rank of each compute worker; stages placed by the kind) or
    `reduce_grad`, a training step is lowered onto ranks: this process (`rank`) runs its
    compute workers (each send after the task that produced its tensor) and two
    communication workers for the receives and gradient reductions; every rank's program is
    dry-run together once when the schedule is built.
    `skips` are the (stash stage, pop stage) pairs of the model's skip connections: a pair
    whose stages sit on two ranks gets its own sends and receives. The ranks (positions in
    the pipeline group) in `inline_receives` take their receives on the compute worker that
    needs them (those whose every message comes over shared memory)."""

    def __init__(
        self,
        stage_workers: Sequence[int],
        kind: str,
        *,
        worker_ranks: Sequence[int] | None = None,
        rank: int = 0,
        reduce_grad: bool = False,
        skips: Sequence[tuple[int, int]] = (),
        inline_receives: Sequence[int] = (),
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
        self.skips = list(skips)
        self.inline_receives = list(inline_receives)
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
                    self.worker_ranks, self.reduce_grad, self.rank, self.skips,
                    self.inline_receives,
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
                    self.worker_ranks, self.rank, self.skips, self.inline_receives,
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

"""The choices of a plan: given ones, and the ones gf.plan searches under a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

from gpipe_fast.arguments import check_choice, check_int
from gpipe_fast.schedule.registry import check_schedule

CHECKPOINTS = ("never", "except_last", "always")


@dataclass(frozen=True)
class Candidate:
    """One way to run the step: what the simulator and the memory walk are asked about."""

    chunks: int
    checkpoint: str
    schedule: str
    dp: int = 1
    dp_shard: bool = False


@dataclass(frozen=True)
class Choice:
    """gf.plan's choices as given: None where it is to search (with a budget only)."""

    chunks: int | None
    checkpoint: str | None
    schedule: str | None
    dp: int
    dp_shard: bool | None
    budget: int | None

    @classmethod
    def check(
        cls,
        chunks: object,
        checkpoint: object,
        schedule: object,
        dp: object,
        dp_shard: object,
        budget: object,
    ) -> Choice:
        if dp_shard is not None and not isinstance(dp_shard, bool):
            raise TypeError(f"dp_shard must be a bool or None, got {type(dp_shard).__name__}")
        return cls(
            chunks=None if chunks is None else check_int(chunks, "chunks", 1),
            checkpoint=None
            if checkpoint is None
            else check_choice(checkpoint, "checkpoint", CHECKPOINTS),
            schedule=None if schedule is None else check_schedule(schedule),
            dp=check_int(dp, "dp", 1),
            dp_shard=dp_shard,
            budget=None if budget is None else check_int(budget, "memory_per_device", 1),
        )

    def only(self) -> Candidate:
        """The one candidate of fully given choices (dp_shard None: not sharded); ValueError
        naming what is missing."""
        missing = [
            name
            for name, value in (
                ("chunks", self.chunks),
                ("checkpoint", self.checkpoint),
                ("schedule", self.schedule),
            )
            if value is None
        ]
        if missing:
            raise ValueError(
                f"{', '.join(missing)}: give a value, or memory_per_device= for gf.plan to choose"
            )
        assert self.chunks and self.checkpoint and self.schedule
        return Candidate(self.chunks, self.checkpoint, self.schedule, self.dp, bool(self.dp_shard))

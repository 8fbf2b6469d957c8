"""What the ranks of a tuning pipe agree on: the source rank's decisions, the slowest rank's time.

The source is the rank of cell 0 in the first replica: it holds the input (what gf.plan
prices) and decides; every other rank takes its decisions, so that all build, run and keep
the same candidates in the same order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gpipe_fast.distributed.layout import ProcessLayout

T = TypeVar("T")


class Agreement:
    """The pipe's pipeline and data-parallel groups, as the tuning uses them (in one process
    without groups, every call is this process's own)."""

    def __init__(self, layout: ProcessLayout) -> None:
        self.pp_group = layout.pp_group if layout.multi_process else None
        self.dp_group = layout.dp_group
        self.pp_source = layout.pp_ranks[0] if self.pp_group is not None else None
        self.dp_source = dist.get_process_group_ranks(self.dp_group)[0] if self.dp_group else None
        self.is_source = layout.pp_index == 0 and (
            self.dp_group is None or dist.get_rank() == self.dp_source
        )

    @property
    def shows_progress(self) -> bool:
        """Whether this rank draws the progress bar: the job's first rank, or one process."""
        return not dist.is_initialized() or dist.get_rank() == 0

    def decided(self, decide: Callable[[], T]) -> T:
        """`decide()` run on the source and its value on every rank. An error there is raised
        on every rank (the source's own; a RuntimeError naming it elsewhere)."""
        value: Any = None
        error: BaseException | None = None
        if self.is_source:
            try:
                value = ("ok", decide())
            except Exception as raised:
                error = raised
                value = ("error", f"{type(raised).__name__}: {raised}")
        value = self._broadcast(value)
        if error is not None:
            raise error
        if value[0] == "error":
            raise RuntimeError(f"gpipe_fast: tuning failed on the source rank: {value[1]}")
        return value[1]  # type: ignore[no-any-return]

    def _broadcast(self, value: Any) -> Any:
        # The replicas' first ranks (cell 0's) from the source, then each pipeline from its
        # first rank: every rank takes part in both, in the same order.
        for group, source in ((self.dp_group, self.dp_source), (self.pp_group, self.pp_source)):
            if group is not None:
                box = [value]
                dist.broadcast_object_list(box, src=source, group=group)
                value = box[0]
        return value

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's `seconds`."""
        return self._largest(seconds)

    def everywhere(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank."""
        return self._largest(0.0 if flag else 1.0) == 0.0

    def _largest(self, number: float) -> float:
        for group in (self.pp_group, self.dp_group):
            if group is not None:
                value = torch.tensor([number], dtype=torch.float64, device=_device_of(group))
                dist.all_reduce(value, dist.ReduceOp.MAX, group=group)
                number = float(value.item())
        return number

    def gathered(self, value: T) -> list[T]:
        """Every rank's `value` of this pipeline, in pipeline order."""
        if self.pp_group is None:
            return [value]
        found: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(found, value, group=self.pp_group)
        return found


def _device_of(group: Any) -> torch.device:
    """Where a collective of `group` takes its tensors: NCCL's on this process's GPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

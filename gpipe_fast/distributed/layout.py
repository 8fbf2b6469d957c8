"""Where a pipe's stages run across processes: its pipeline and data-parallel groups, checked."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpipe_fast.arguments import check_cuda_device
from gpipe_fast.schedule.registry import placement, schedule_kind, schedules


def _ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group))


@dataclass(frozen=True)
class ProcessLayout:
    """This process's place: stage s runs on the rank of pp_group at position stage_ranks[s]
    (the schedule kind's placement of the stages on the pp_size processes), replicated over
    dp_group."""

    pp_group: Any | None
    dp_group: Any | None
    pp_ranks: tuple[int, ...]  # global ranks of the pipeline group, in group order
    pp_index: int  # this process's position in the pipeline group
    stages: int
    stage_ranks: tuple[int, ...] = ()  # position of each stage's process (empty: all here)

    @property
    def pp_size(self) -> int:
        return len(self.pp_ranks)

    @property
    def multi_process(self) -> bool:
        return self.pp_size > 1

    def stage_rank(self, stage: int) -> int:
        """The position in the pipeline group of the process that runs `stage`."""
        return self.stage_ranks[stage] if self.stage_ranks else 0

    def is_local(self, stage: int) -> bool:
        return self.stage_rank(stage) == self.pp_index

    def global_rank(self, stage: int) -> int:
        return self.pp_ranks[self.stage_rank(stage)]

    @property
    def local_cells(self) -> list[int]:
        """The cells this process runs (the native core's stages: `stages`, `stage_rank`)."""
        return [s for s in range(self.stages) if self.is_local(s)]

    @property
    def local_stages(self) -> list[int]:
        """The older name of `local_cells`, kept."""
        return self.local_cells


def check_groups(pp_group: Any | None, dp_group: Any | None) -> None:
    """ValueError naming the group this process cannot use (torch.distributed not initialised,
    or this process not in it)."""
    for name, group in (("pp_group", pp_group), ("dp_group", dp_group)):
        if group is not None and not dist.is_initialized():
            raise ValueError(f"{name}: torch.distributed is not initialised (init_process_group)")
        if group is not None and dist.get_rank(group) < 0:
            raise ValueError(f"{name}: this process (rank {dist.get_rank()}) is not in the group")


def make_layout(
    pp_group: Any | None, dp_group: Any | None, stages: int, schedule: str
) -> ProcessLayout:
    """The layout of `stages` stages over the groups; ValueError naming the argument that
    does not fit."""
    check_groups(pp_group, dp_group)
    if pp_group is None:
        return ProcessLayout(None, dp_group, (0,), 0, stages)
    ranks = tuple(_ranks(pp_group))
    if stages % len(ranks):
        raise ValueError(
            f"balance: {stages} cells cannot be shared by a pp_group of {len(ranks)} processes; "
            f"give a multiple of {len(ranks)} (V cells per process)"
        )
    per_process = stages // len(ranks)
    per = schedule_kind(schedule).stages_per_worker
    if per and per_process != per:
        fits = [k for k in schedules() if schedule_kind(k).stages_per_worker in (0, per_process)]
        raise ValueError(
            f"balance: {stages} cells on {len(ranks)} processes means {per_process} cells per "
            f"process, but schedule={schedule!r} runs {per}; give {per * len(ranks)} cells "
            f"or a schedule that runs {per_process}: {', '.join(map(repr, fits))}"
        )
    if dp_group is not None:
        shared = set(ranks) & set(_ranks(dp_group))
        if shared != {dist.get_rank()}:
            raise ValueError(
                f"dp_group: it overlaps pp_group in ranks {sorted(shared)}; a mesh's dp and pp "
                "groups share only this process (init_device_mesh(..., ('dp', 'pp')))"
            )
    stage_ranks = tuple(placement(schedule, stages, len(ranks)))
    return ProcessLayout(pp_group, dp_group, ranks, dist.get_rank(pp_group), stages, stage_ranks)


def default_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK with CUDA, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def check_device(devices: Any, layout: ProcessLayout) -> torch.device:
    """The one device of this process's cells: `devices` (one device, or a list of one)
    must be this rank's own."""
    if devices is None:
        return default_device()
    given = list(devices) if isinstance(devices, (list, tuple)) else [devices]
    resolved = {torch.device(d) for d in given}
    if len(resolved) != 1:
        raise ValueError(
            f"devices: with pp_group, each process runs its cells on its own device; got {given}"
        )
    device = resolved.pop()
    if device.type == "cuda":
        device = check_cuda_device(device, "devices")
        expected = default_device()
        if device.index != expected.index:
            raise ValueError(
                f"devices: {device} is not this rank's device ({expected}, from LOCAL_RANK)"
            )
    return device

"""The job's processes as a pp x dp mesh: this rank's pipeline group and its replicas' group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gpipe_fast.arguments import check_int


@dataclass(frozen=True)
class Mesh:
    """Where this process sits: pipeline `pp_index` of `pp_size` stages' processes, replica
    `dp_index` of `dp_size`. Global rank = dp_index * pp_size + pp_index, so a pipeline's
    processes are neighbours (on one host first)."""

    pp_size: int
    dp_size: int
    pp_index: int
    dp_index: int
    pp_group: Any | None  # None: one process runs every stage
    dp_group: Any | None  # a process group or a one-dimensional DeviceMesh; None: one replica

    @property
    def world(self) -> int:
        return self.pp_size * self.dp_size

    @property
    def distributed(self) -> bool:
        return self.world > 1


def build_mesh(pp_size: int | None) -> Mesh:
    """The mesh of the running job: one process (no torch.distributed, or a world of one)
    runs every stage; across processes, `pp_size` of them (default: all) run one pipeline
    and the world size over `pp_size` replicas of it train on different batches."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if pp_size is not None:
        pp_size = check_int(pp_size, "pp_size", 1, "an int >= 1 or None")
    if world == 1:
        if pp_size not in (None, 1):
            raise ValueError(
                f"pp_size={pp_size}, but this job is one process: launch it with torchrun "
                f"--nproc-per-node {pp_size} (or more), or leave pp_size out to run every "
                "stage here"
            )
        return Mesh(1, 1, 0, 0, None, None)
    pp = world if pp_size is None else pp_size
    if world % pp:
        raise ValueError(
            f"pp_size={pp} does not divide the {world} processes of this job into pipelines; "
            f"give a divisor of {world}"
        )
    dp, rank = world // pp, dist.get_rank()
    if dp == 1:
        return Mesh(pp, 1, rank, 0, dist.group.WORLD, None)
    if pp == 1:
        return Mesh(1, dp, 0, rank, None, dist.group.WORLD)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (dp, pp), mesh_dim_names=("dp", "pp"))
    return Mesh(pp, dp, rank % pp, rank // pp, mesh["pp"].get_group(), mesh["dp"])

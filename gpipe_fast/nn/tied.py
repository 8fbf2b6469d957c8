"""Parameters shared by several cells (a tied embedding and head): replicas and summed gradients.

Cells on one device share the tensor itself: the autograd engine adds every use's gradient.
A cell on another device of the same process gets a replica, refreshed from the user's
parameter before each step; its gradient is added into the user's after the backward. Across
processes each owning rank holds its own copy: their gradients are summed over the pipeline
group, so every copy ends the step with the whole gradient and optimizer steps keep them equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe_fast.nn.dtensors import is_dtensor

Place = tuple[int, str]  # (cell, the parameter's name in the cell)


@dataclass
class Tie:
    """One parameter that several cells hold."""

    places: list[Place]
    replicas: list[tuple[nn.Parameter, nn.Parameter]] = field(default_factory=list)

    @property
    def cells(self) -> list[int]:
        return sorted({cell for cell, _ in self.places})


def find_ties(cells: Sequence[nn.Module]) -> list[Tie]:
    """The parameters held by more than one cell, in order of first appearance."""
    places: dict[int, list[Place]] = {}
    for k, cell in enumerate(cells):
        for name, param in cell.named_parameters(remove_duplicate=False):
            found = places.setdefault(id(param), [])
            if not any(cell_ == k for cell_, _ in found):
                found.append((k, name))
    return [Tie(found) for found in places.values() if len({c for c, _ in found}) > 1]


def _set(cell: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attribute = name.rpartition(".")
    setattr(cell.get_submodule(owner) if owner else cell, attribute, param)


def _get(cell: nn.Module, name: str) -> nn.Parameter:
    owner, _, attribute = name.rpartition(".")
    return getattr(cell.get_submodule(owner) if owner else cell, attribute)  # type: ignore[no-any-return]


def replicate_across_devices(
    cells: Sequence[nn.Module], devices: Sequence[torch.device], ties: list[Tie]
) -> None:
    """Gives each cell on another device than a tie's first cell its own replica (before the
    cells are moved: moving the shared tensor would take it from the first cell)."""
    for tie in ties:
        first_cell, first_name = tie.places[0]
        owner = _get(cells[first_cell], first_name)
        by_device: dict[torch.device, nn.Parameter] = {}
        for cell, name in tie.places[1:]:
            device = devices[cell]
            if device == devices[first_cell]:
                continue
            replica = by_device.get(device)
            if replica is None:
                replica = by_device[device] = nn.Parameter(
                    owner.detach().clone(), requires_grad=owner.requires_grad
                )
                tie.replicas.append((owner, replica))
            _set(cells[cell], name, replica)


def retie(cells: Sequence[nn.Module], ties: list[Tie], local: Sequence[bool]) -> None:
    """After this process's cells were materialised from the meta device (each got tensors
    of its own), makes the cells of one device share each tie's tensor again."""
    for tie in ties:
        mine = [(cell, name) for cell, name in tie.places if local[cell]]
        if len(mine) < 2:
            continue
        first = _get(cells[mine[0][0]], mine[0][1])
        for cell, name in mine[1:]:
            if _get(cells[cell], name).device == first.device:
                _set(cells[cell], name, first)


class TiedGradients:
    """Keeps a pipe's ties in step: replicas refreshed before a step, gradients summed after
    its backward (into the user's parameter in one process; over the pipeline group across
    processes), then over the data-parallel group once per tie, however many cells, devices
    or ranks hold it."""

    def __init__(self, cells: Sequence[nn.Module], ties: list[Tie], layout: Any) -> None:
        self.ties = ties
        self.layout = layout
        # Per tie: the tensor of this process that ends the step with the tie's whole gradient
        # (the user's parameter in one process, this rank's copy across processes; None: no
        # cell of it here), and the shape and dtype that every rank's sum uses.
        self.shared: list[tuple[Tensor | None, torch.Size, torch.dtype]] = []
        # Every tensor of a tie held here (copies and replicas): the cells' own gradient
        # reductions leave them out, since several cells hold them (see reduce_over_replicas).
        self.members: set[int] = set()
        for tie in ties:
            mine = [_get(cells[c], n) for c, n in tie.places if layout.is_local(c)]
            any_place = _get(cells[tie.places[0][0]], tie.places[0][1])
            self.shared.append((mine[0] if mine else None, any_place.shape, any_place.dtype))
            self.members.update(id(t) for t in mine)
            self.members.update(id(replica) for _, replica in tie.replicas)

        # Sharded stages (dp_shard): (dp size, this rank's place in it). A tie's copy is then
        # a shard, whose gradient is summed over the pipeline group shard by shard.
        self.shard_of: tuple[int, int] | None = None

    def __bool__(self) -> bool:
        return bool(self.ties)

    def refresh(self, cells: Sequence[nn.Module | None], shard_of: tuple[int, int]) -> None:
        """After the stages were sharded (their parameters replaced by shards): this
        process's copy of each tie as its cell now holds it."""
        self.shard_of = shard_of
        self.members = set()
        for i, tie in enumerate(self.ties):
            mine = [_get(cell, n) for c, n in tie.places if (cell := cells[c]) is not None]
            _, shape, dtype = self.shared[i]
            self.shared[i] = (mine[0] if mine else None, shape, dtype)
            self.members.update(id(t) for t in mine)

    def before_step(self) -> None:
        with torch.no_grad():
            for tie in self.ties:
                for owner, replica in tie.replicas:
                    replica.copy_(owner)

    def after_backward(self, guard: Any = None, device: torch.device | None = None) -> None:
        """Each tie's gradient summed into its tensor here: from the replicas on other devices,
        then, across processes, over the pipeline group."""
        for tie in self.ties:
            for owner, replica in tie.replicas:
                if replica.grad is None:
                    continue
                grad = replica.grad.to(owner.device)
                owner.grad = grad if owner.grad is None else owner.grad + grad
                replica.grad = None
        if not self.layout.multi_process:
            return
        requests = []
        for param, shape, dtype in self.shared:
            # A rank holding no copy adds zeros: the sum needs every rank of the group.
            grad = torch.zeros(self._local_shape(shape), dtype=dtype, device=device)
            if param is not None:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                # A shard's own rows: the group's ranks hold the same.
                grad = local_part(param.grad)
            requests.append(dist.all_reduce(grad, group=self.layout.pp_group, async_op=True))
        guard.wait(requests, "the tied parameters' gradients", group=self.layout.pp_group)

    def _local_shape(self, shape: torch.Size) -> tuple[int, ...]:
        """The shape of this rank's part of a tie: the whole, or its shard's rows (FSDP2
        shards dim 0 as torch.chunk does)."""
        if self.shard_of is None or not shape:
            return tuple(shape)
        size, place = self.shard_of
        per = -(-shape[0] // size)
        rows = max(0, min(shape[0], (place + 1) * per) - place * per)
        return (rows, *shape[1:])

    def counted_elsewhere(self) -> set[int]:
        """This process's copies of the ties whose first cell another rank runs: that rank
        counts the tie in the model's gradient norm, so that it counts once."""
        return {
            id(param)
            for tie, (param, _, _) in zip(self.ties, self.shared, strict=True)
            if param is not None and not self.layout.is_local(tie.cells[0])
        }

    def local_tensors(self) -> list[Tensor]:
        """This process's tensor of each tie it holds, once each."""
        return [param for param, _, _ in self.shared if param is not None]


def local_part(tensor: Tensor) -> Tensor:
    """This rank's part of a tensor: a shard's local rows (DTensor), or the tensor."""
    return tensor.to_local() if is_dtensor(tensor) else tensor

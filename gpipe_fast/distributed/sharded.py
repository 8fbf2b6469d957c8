"""Each stage sharded over its data-parallel group with FSDP2, and when it communicates.

A cell's layers that hold parameters are FSDP units, then the cell itself (the root of its
units, holding whatever parameters no layer owns). A unit's parameters, gradients and the
optimizer's state are shards at rest: 1/dp of the unit per rank, plus padding. Within a
task a unit is gathered (all-gather) when it runs and, as the policy says, freed again.

The policy (``dp_shard_sync``, ``reshard_after_forward``; the guide counts the
collectives each makes):

- ``"per_microbatch"``: a micro-batch's gradients are reduce-scattered as its backward
  goes, unit by unit (FSDP's own hooks), so that no more than one unit's gradients are
  ever whole. With a split backward (zero bubble, zbv) the weight half comes later, so the
  reduce-scatter follows each micro-batch's weight task instead.
- ``"per_step"``: gradients accumulate whole and are reduce-scattered once, after the
  stage's last backward task: the fewest collectives, the memory of the whole stage's
  gradients during the step.

Every unit's collectives run on the thread of its cell's worker, one task at a time, in
the program's order, which is the same on every replica; each cell has a process group of
its own, so that two cells of one process never interleave collectives on one group. On the
CPU they are waited for as every other wait of a step is (sharded_comms.py): another rank's
failure ends them, and a replica that died or does not answer is named.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from gpipe_fast.arguments import check_bool
from gpipe_fast.distributed.guard import Guard
from gpipe_fast.distributed.sharded_comms import guard_collectives

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

# torch.distributed.fsdp is imported where a stage is sharded, not with this module: it takes
# about 0.8 s (DTensor and its operators), a second more on every `import gpipe_fast` that
# shards nothing.

SYNCS = ("per_microbatch", "per_step")


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _state(module: Any) -> Any:
    """FSDP's state of a unit (its private object: the per-group post-backward and the
    end-of-backward callback are not public; torch.distributed.pipelining calls them too)."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(module)  # type: ignore[attr-defined]


def dp_group_of(dp_group: Any) -> Any:
    """The process group of `dp_group`: a process group, or a one-dimensional DeviceMesh."""
    if isinstance(dp_group, DeviceMesh):
        if dp_group.ndim != 1:
            raise ValueError(
                f"dp_group: a DeviceMesh must be one-dimensional, got {dp_group.ndim} "
                f"dimensions {dp_group.mesh_dim_names}; pass mesh['dp']"
            )
        return dp_group.get_group()
    return dp_group


def check_sharding(
    dp_shard: object, sync: object, reshard_after_forward: object, dp_group: Any
) -> None:
    """ValueError or TypeError naming the sharding argument that does not fit."""
    check_bool(dp_shard, "dp_shard")
    check_bool(reshard_after_forward, "reshard_after_forward")
    if sync not in SYNCS:
        raise ValueError(
            f"dp_shard_sync must be one of {', '.join(map(repr, SYNCS))}, got {sync!r}"
        )
    if dp_shard and dp_group is None:
        raise ValueError("dp_shard: sharding needs a dp_group to shard each stage over")


class ShardedCell:
    """One cell's FSDP units over its own copy of the data-parallel group, and the work its
    stage's tasks add around them; `guard` waits for their collectives on the CPU."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        group: Any,
        device: torch.device,
        *,
        sync: str,
        reshard_after_forward: bool,
        split: bool,
        guard: Guard | None = None,
    ) -> None:
        self.index = index
        self.group = group
        self.guard = guard
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, device.type)
        layers = [layer for layer in module.children() if _owns_parameters(layer)]
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
        self.root: FSDPModule = module  # type: ignore[assignment]
        self.units: list[FSDPModule] = [*layers, self.root]  # type: ignore[list-item]
        self.layers = list(module.children())
        for unit in self.units:
            if guard is not None and device.type == "cpu":
                guard_collectives(_state(unit)._fsdp_param_groups, guard, index)
            # The loss weights already make each replica's gradient its share of the whole
            # batch's: the replicas' gradients are summed, not averaged.
            unit.set_gradient_divide_factor(1.0)
            # A plain sum: FSDP would pre-multiply by 1/1 in float32 and bfloat16, an op
            # gloo does not have.
            unit.set_force_sum_reduction_for_comms(True)
            # FSDP prefetches the unit that ran before in its record of forwards; with
            # several micro-batches in flight that is another micro-batch's unit, gathered
            # for nothing. A unit named as its own prefetch makes it a no-op.
            unit.set_modules_to_backward_prefetch([unit])
        # The root is known before any forward: a split forward calls the layers alone.
        _state(module)._lazy_init()
        self.sync = sync
        # FSDP's own hooks reduce-scatter unit by unit only when the backward is whole.
        self.native = sync == "per_microbatch" and not split
        # A weight half gathers what it needs itself; so the stage stays whole between
        # tasks only when nothing asks to free it.
        self.reshard_after_backward = self.native or reshard_after_forward
        self._set(sync=self.native, reshard=self.reshard_after_backward)
        self._busy = threading.Lock()
        self._digest = hashlib.sha1()
        self.backwards = 0

    def _set(self, *, sync: bool, reshard: bool) -> None:
        self.root.set_requires_gradient_sync(sync, recurse=True)
        self.root.set_reshard_after_backward(reshard, recurse=True)

    # -- around the stage's tasks ----------------------------------------------------------

    @contextmanager
    def task(self, action: str, microbatch: int) -> Iterator[None]:
        """One task's FSDP work: refused if another task of the cell is in flight (FSDP's
        state is one per cell), and recorded so that replicas can compare their orders."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"gpipe_fast: cell {self.index}'s sharded stage ran two tasks at once "
                f"({action} {microbatch} while another was running); its FSDP work must "
                "run one task at a time"
            )
        try:
            self._digest.update(f"{action}:{microbatch};".encode())
            yield
        finally:
            self._busy.release()

    def gather(self) -> None:
        """Every unit whole (before a weight half of a split backward, whose graph reads the
        parameters that FSDP's backward hooks freed after the input half)."""
        for unit in self.units:
            unit.unshard()

    def backward_done(self, count: int) -> None:
        """After a micro-batch's last backward task on this stage (of `count` in the step):
        its gradients reduce-scattered where the policy says so."""
        self.backwards += 1
        if self.native:
            return
        if self.sync == "per_microbatch" or self.backwards == count:
            self.reduce_scatter()

    def reduce_scatter(self) -> None:
        """The whole gradients each unit holds reduce-scattered into its shards (added to
        what they hold), the units freed. As torch.distributed.pipelining ends a stage's
        backward: FSDP's post-backward per group, then its end-of-backward callback."""
        self._set(sync=True, reshard=True)
        try:
            state = _state(self.root)
            for unit_state in state._state_ctx.all_states:
                for group in reversed(unit_state._fsdp_param_groups):
                    group.post_backward()
            state._root_post_backward_final_callback()
        finally:
            self._set(sync=self.native, reshard=self.reshard_after_backward)

    def reshard(self) -> None:
        for unit in self.units:
            unit.reshard()

    def start_step(self) -> None:
        self.backwards = 0
        self._digest = hashlib.sha1()

    def digest(self) -> int:
        """The order of this step's tasks, as a number replicas compare."""
        return int.from_bytes(self._digest.digest()[:7], "little")

    def layer_parameters(self) -> list[list[Tensor]]:
        """Per layer, the parameters its autograd graph holds (a unit's whole ones, FSDP's
        gathered tensors: not the shards the module shows between tasks)."""
        from torch.distributed.fsdp import FSDPModule

        out: list[list[Tensor]] = []
        for layer in self.layers:
            state = _state(layer) if isinstance(layer, FSDPModule) else None
            if state is None:
                out.append([p for p in layer.parameters() if p.requires_grad])
                continue
            out.append([
                fsdp_param.unsharded_param
                for group in state._fsdp_param_groups
                for fsdp_param in group.fsdp_params
                if fsdp_param.sharded_param.requires_grad
            ])  # fmt: skip
        return out

    def reset(self) -> None:
        """After a failed step: FSDP's state of the step dropped, the units freed."""
        _state(self.root)._reset_iter_state()
        self._set(sync=self.native, reshard=self.reshard_after_backward)
        self.reshard()


# The process groups of sharded cells, by (the replicas' ranks, the cell's place among this
# process's cells, timeout): made once per process and reused by every later pipe. A group
# destroyed with its pipe would free its name for the next group, whose rendezvous could then
# read the keys the destroyed one left in the store.
_CELL_GROUPS: dict[tuple[tuple[int, ...], int, float], Any] = {}


def _cell_group(ranks: tuple[int, ...], slot: int, timeout_s: float) -> Any:
    """A process group of `ranks` for this process's cell number `slot`: cells of one process
    run on their own workers at once, each on a group of its own. Its collectives wait no
    longer than the pipe's timeout for a replica (on the CPU the guard's wait ends them
    sooner). One destroyed since (the job's process group was, after a failed step) is made
    anew."""
    key = (ranks, slot, timeout_s)
    group = _CELL_GROUPS.get(key)
    if group is None or group not in c10d._world.pg_map:
        group = _CELL_GROUPS[key] = dist.new_group(
            list(ranks), timeout=timedelta(seconds=timeout_s), use_local_synchronization=True
        )
    return group


class Sharding:
    """The sharded cells of this process, by stage."""

    def __init__(
        self,
        modules: Sequence[nn.Module | None],
        devices: Sequence[torch.device],
        dp_group: Any,
        *,
        sync: str,
        reshard_after_forward: bool,
        split: bool,
        timeout_s: float,
        guard: Guard | None = None,
    ) -> None:
        ranks = tuple(dist.get_process_group_ranks(dp_group))
        self.guard = guard
        self.cells: dict[int, ShardedCell] = {}
        local = [k for k, module in enumerate(modules) if module is not None]
        for slot, k in enumerate(local):
            module = modules[k]
            assert module is not None
            group = _cell_group(ranks, slot, timeout_s)
            self.cells[k] = ShardedCell(
                k, module, group, devices[k], sync=sync,
                reshard_after_forward=reshard_after_forward, split=split, guard=guard,
            )  # fmt: skip

    def start_step(self) -> None:
        for cell in self.cells.values():
            cell.start_step()

    def check_order(self) -> None:
        """Every replica ran each cell's tasks in the same order (one small all-gather per
        cell); RuntimeError naming the cell and the ranks otherwise."""
        for k, cell in self.cells.items():
            mine = torch.tensor([cell.digest()], dtype=torch.int64)
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size(cell.group))]
            request = dist.all_gather(every, mine, group=cell.group, async_op=True)
            what = f"the order of cell {k}'s sharded tasks on its replicas"
            if self.guard is not None:
                self.guard.wait(request, what, group=cell.group)
            else:
                request.wait()
            if any(int(t) != int(mine) for t in every):
                ranks = dist.get_process_group_ranks(cell.group)
                raise RuntimeError(
                    f"gpipe_fast: the replicas of cell {k} (ranks {ranks}) ran its sharded "
                    "tasks in different orders; every replica must run the same schedule "
                    "with the same chunks"
                )

    def reshard(self) -> None:
        for cell in self.cells.values():
            cell.reshard()

    def reset(self) -> None:
        for cell in self.cells.values():
            cell.reset()

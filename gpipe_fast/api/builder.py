"""A pipe's parts built from GPipe's arguments: layout, cells, meta tensors, ties, threads."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gpipe_fast.api import optim_state
from gpipe_fast.api.auto import Tuned, check_tunable
from gpipe_fast.api.devices import default_balance, single_process_devices
from gpipe_fast.api.naming import Naming, place_key
from gpipe_fast.api.state_dict import Cells
from gpipe_fast.arguments import (
    check_balance,
    check_bool,
    check_checkpoint,
    check_chunks,
    check_devices,
    check_int,
    check_sequential,
    check_timeout,
)
from gpipe_fast.balancing.balance import balance_by_params
from gpipe_fast.device import host
from gpipe_fast.distributed.agreement import agree, stage_parameters
from gpipe_fast.distributed.host_peers import host_peers
from gpipe_fast.distributed.layout import ProcessLayout, check_device, check_groups, make_layout
from gpipe_fast.distributed.sharded import check_sharding, dp_group_of
from gpipe_fast.nn.batchnorm import DeferredBatchNorm
from gpipe_fast.nn.materialize import Unfilled, Uninitialised, materialize, warn_uninitialised
from gpipe_fast.nn.tied import Tie, TiedGradients, find_ties, replicate_across_devices, retie
from gpipe_fast.runtime.pipeline import Pipeline
from gpipe_fast.schedule.registry import check_schedule, schedule_kind
from gpipe_fast.skip.layout import SkipLayout, inspect_skip_layout
from gpipe_fast.skip.skippable import Skippable
from gpipe_fast.skip.verify import verify_skippables

# Appended to errors about a balance that does not fit the module.
BALANCE_ADVICE = (
    "let gpipe_fast choose one: balance=None (by parameter count), "
    "gf.balance_by_params(cells, module), gf.balance_by_time(cells, module, sample) or "
    "gf.balance_by_size(cells, module, sample)"
)


@dataclass(frozen=True)
class LayerKind:
    """What a pipe's layers are: an nn.Sequential's own (GPipe), or a model's stages
    (gf.pipeline: ``transparent`` layers, left out of keys, which may share a buffer their
    glue reads; ``cut`` says how the model was cut beyond the balance, for the ranks to
    compare)."""

    transparent: bool = False
    # GPipe's own cells keep one buffer each, as running statistics could not be kept in step.
    shared_buffers: bool = False
    cut: dict[str, object] = field(default_factory=dict)


@dataclass
class Built:
    """What a build made, for the pipe to hold."""

    balance: list[int]
    devices: list[torch.device]
    chunks: int
    checkpoint: str
    schedule: str
    layout: ProcessLayout
    partitions: Cells  # this process's cells
    naming: Naming
    unfilled: Unfilled  # tensors from the meta device that hold no values yet
    threads: host.Threads
    pipeline: Pipeline | None  # None for an empty pipe: no cells, no workers
    # get_state_dict(pipe, optimizer)'s names across processes (None in one process).
    optimizer_names: optim_state.PipeNames | None


class PipeBuilder:
    """Builds a pipe of `module` cut by `balance` from GPipe's other `arguments` (by name),
    its layers of `kind`: checks the arguments, places the cells (agreed across ranks), cuts
    and materialises them, ties their shared weights, shares the cores, starts the Pipeline."""

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None,
        arguments: dict[str, Any],
        kind: LayerKind,
    ) -> None:
        self.kind = kind
        self.arguments = arguments
        a = arguments
        schedule, chunks, checkpoint = a["schedule"], a["chunks"], a["checkpoint"]
        self.tuned = Tuned.of(schedule, chunks, checkpoint, cut_given=balance is not None)
        if self.tuned is not None:
            check_tunable(self.tuned, a["dp_shard"])
            schedule, chunks, checkpoint = self.tuned.initial(schedule, chunks, checkpoint)
        self.dp_group = dp_group_of(a["dp_group"])
        self.dp_shard = a["dp_shard"]
        check_sharding(self.dp_shard, a["dp_shard_sync"], a["reshard_after_forward"], self.dp_group)
        self.module = check_sequential(module)
        self.balance = balance
        self.chunks = check_chunks(chunks)
        self.checkpoint = check_checkpoint(checkpoint)
        check_bool(a["recompute_pool"], "recompute_pool")
        self.schedule = check_schedule(schedule)
        self.timeout = check_timeout(a["timeout"])
        init_fn = a["init_fn"]
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn must be callable or None, got {type(init_fn).__name__}")
        self.skippable = any(isinstance(layer, Skippable) for layer in self.module.children())
        if self.skippable:
            verify_skippables(self.module)  # TypeError naming every unmatched stash or pop

    def build(self) -> Built:
        balance, layout, devices, stage_workers = self.place()
        cells, ties, skips = self.cut(balance, layout, devices)
        unfilled = self.materialise(cells, layout, devices)
        here = [layout.is_local(k) for k in range(len(cells))]
        retie(cells, ties, here)
        local = [cells[k] for k in layout.local_stages] if cells else []
        naming = Naming.of(self.module._modules, cells, local, self.kind.transparent)
        self.check_ties(ties, layout, naming)
        threads, hosts = self.threads(layout, [devices[k] for k in layout.local_stages])
        pipeline = (
            self.pipeline(
                cells, devices, threads, stage_workers, layout, ties, skips, hosts, unfilled
            )
            if cells
            else None
        )
        optimizer_names = None
        if layout.multi_process and pipeline is not None and pipeline.groups:
            optimizer_names = optim_state.PipeNames(
                plain_names=optim_state.tie_copy_names(ties, layout.is_local, naming.place_key),
                gather=partial(optim_state.gather_over_pipeline, pipeline.groups),
                ranks=layout.pp_ranks,
            )
        return Built(
            list(balance), devices, self.chunks, self.checkpoint, self.schedule, layout,
            Cells(local), naming, unfilled, threads, pipeline, optimizer_names,
        )  # fmt: skip

    def place(self) -> tuple[list[int], ProcessLayout, list[torch.device], list[int]]:
        """The balance, the layout of processes, each cell's device and worker; across
        processes, after the ranks agreed on what they build."""
        a, module, balance, schedule = self.arguments, self.module, self.balance, self.schedule
        pp_group = a["pp_group"]
        if pp_group is not None:
            size = dist.get_world_size(pp_group)
            if balance is None:  # the cells the schedule runs on each process (1 unless fixed)
                per = schedule_kind(schedule).stages_per_worker or 1
                balance = balance_by_params(size * per, module)
            balance = check_balance(balance, len(module), advice=BALANCE_ADVICE)
            self.agree(balance, pp_group)
            layout = make_layout(pp_group, self.dp_group, len(balance), schedule)
            device = check_device(a["devices"], layout)
            stage_workers = [layout.stage_rank(k) for k in range(len(balance))]
            return balance, layout, [device] * len(balance), stage_workers
        given_devices = None if a["devices"] is None else check_devices(a["devices"])
        if balance is None:
            balance = default_balance(module, given_devices, schedule)
        balance = check_balance(balance, len(module), advice=BALANCE_ADVICE)
        if self.dp_group is not None:
            self.agree(balance, None)
        layout = make_layout(None, self.dp_group, len(balance), schedule)
        devices, stage_workers = single_process_devices(given_devices, balance, schedule)
        return balance, layout, devices[: len(balance)], stage_workers

    def agree(self, balance: Sequence[int], pp_group: Any | None) -> None:
        """The same ValueError on every rank when the ranks build this pipe differently: its
        cut (the balance, and a pipe of any model's split points), the arguments that shape
        its steps, its groups' sizes, and each stage's parameters by name and shape. One
        all-gather of a digest, before any other communication of the build: no rank then
        waits in a collective another will not run, and no step runs on a disagreement."""
        a, dp_group = self.arguments, self.dp_group
        check_groups(pp_group, dp_group)
        groups = {
            name: None if group is None else dist.get_world_size(group)
            for name, group in (("pp_group size", pp_group), ("dp_group size", dp_group))
        }
        agree({
            **self.kind.cut,
            "balance": list(balance),
            "chunks": self.chunks,
            "checkpoint": self.checkpoint,
            "schedule": self.schedule,
            "deferred_batch_norm": a["deferred_batch_norm"],
            "dp_shard": self.dp_shard,
            "dp_shard_sync": a["dp_shard_sync"] if self.dp_shard else None,
            "reshard_after_forward": a["reshard_after_forward"] if self.dp_shard else None,
            **groups,
            "parameters": stage_parameters(_cut(self.module, balance, False),
                                           drop_layer=self.kind.transparent),
        }, self.timeout)  # fmt: skip

    def cut(
        self, balance: Sequence[int], layout: ProcessLayout, devices: list[torch.device]
    ) -> tuple[list[nn.Sequential], list[Tie], SkipLayout | None]:
        """The cells, the weights they share (in one process, replicated onto each device
        that holds one) and where their skips go."""
        cells = _cut(self.module, balance, self.arguments["deferred_batch_norm"])
        if not self.kind.shared_buffers:
            _reject_shared_buffers(cells)
        skips = _skip_layout(cells) if self.skippable else None
        ties = find_ties(cells)
        if not layout.multi_process:
            replicate_across_devices(cells, devices, ties)
        return cells, ties, skips

    def materialise(
        self, cells: list[nn.Sequential], layout: ProcessLayout, devices: list[torch.device]
    ) -> Unfilled:
        """This process's cells given memory on their devices. Another process's cell stays
        as it is (on the meta device, it never holds memory). Tensors that came from the meta
        device with no initialisation are remembered: the pipe refuses to run until they are
        loaded or set."""
        uninitialised: list[Uninitialised] = []
        for k, device in enumerate(devices):
            if layout.is_local(k):
                cells[k], left = materialize(cells[k], device, self.arguments["init_fn"])
                if self.kind.transparent:  # named by the model's keys, not the stage's
                    left = [replace(u, name=place_key(u.name, True)) for u in left]
                uninitialised += left
        if uninitialised:
            warn_uninitialised(uninitialised)
        return Unfilled(uninitialised)

    def check_ties(self, ties: list[Tie], layout: ProcessLayout, naming: Naming) -> None:
        """dp_shard refuses a weight two cells of one process share. Decided alike on every
        rank (from the layout, not from this rank's cells), so that a refusal is every
        rank's, at once."""
        shared_in_a_process = [
            t for t in ties
            if len({layout.stage_rank(k) for k, _ in t.places}) < len({k for k, _ in t.places})
        ]  # fmt: skip
        if self.dp_shard and shared_in_a_process:
            raise ValueError(
                "dp_shard: a weight tied between two cells of one process cannot be sharded "
                "yet (both cells' FSDP units would hold it; ties across processes can): "
                + "; ".join(
                    " = ".join(f"cell {k}'s {naming.place_key(name)}" for k, name in t.places)
                    + f" (cells {', '.join(map(str, t.cells))} on position "
                    + f"{sorted({layout.stage_rank(k) for k in t.cells})} of pp_group)"
                    for t in shared_in_a_process
                )
            )

    def threads(
        self, layout: ProcessLayout, local_devices: list[torch.device]
    ) -> tuple[host.Threads, Any]:
        """Each CPU cell's intra-op threads, and the hosts of the job's processes. Processes
        of a multi-process pipe share the host's cores: every rank learns the host of every
        other (a collective, so every rank asks, whatever its settings); the pipeline's ranks
        on one host also exchange tensors over shared memory."""
        grouped = layout.multi_process or layout.dp_group is not None
        hosts = host_peers() if grouped else None
        given = self.arguments["threads_per_cell"]
        if given is not None:
            given = check_int(given, "threads_per_cell", 1, "an int or None")
        threads = host.threads_per_cell(
            local_devices,
            processes=hosts.processes_here if hosts is not None else 1,
            one_worker=layout.multi_process,
            given=given,
        )
        if hosts is not None:
            threads = host.share_with_caller(threads, hosts.processes_here)
        return threads, hosts

    def pipeline(
        self,
        cells: list[nn.Sequential],
        devices: list[torch.device],
        threads: host.Threads,
        stage_workers: list[int],
        layout: ProcessLayout,
        ties: list[Tie],
        skips: SkipLayout | None,
        hosts: Any,
        unfilled: Unfilled,
    ) -> Pipeline:
        """The runtime of the cells, its boundary copies ready and, with dp_shard, its
        stages sharded; closed again if that fails."""
        a = self.arguments
        pipeline = Pipeline(
            cells,
            devices,
            threads.per_cell,
            stage_workers=stage_workers,
            schedule=self.schedule,
            recompute_pool=a["recompute_pool"],
            layout=layout,
            timeout_s=self.timeout,
            tied=TiedGradients(cells, ties, layout),
            skips=skips,
            hosts=hosts,
            ready=unfilled.check,
            dp_shard=self.dp_shard,
        )
        try:
            pipeline.sync_copies()
            if self.dp_shard:
                pipeline.shard(
                    sync=a["dp_shard_sync"], reshard_after_forward=a["reshard_after_forward"]
                )
        except BaseException:
            pipeline.close()
            raise
        return pipeline


def _cut(
    module: nn.Sequential, balance: Sequence[int], deferred_batch_norm: bool
) -> list[nn.Sequential]:
    """`module`'s layers cut into cells of `balance` layers each."""
    named = list(module._modules.items())  # named_children() would drop a repeated layer
    cells, start = [], 0
    for size in balance:
        cell = nn.Sequential(OrderedDict(named[start : start + size]))
        if deferred_batch_norm:
            cell = cast(nn.Sequential, DeferredBatchNorm.convert(cell))
        cells.append(cell)
        start += size
    return cells


def _reject_shared_buffers(cells: list[nn.Sequential]) -> None:
    """A buffer (a running statistic) shared by cells could not be kept in step: parameters
    can (gpipe_fast.nn.tied)."""
    owner: dict[int, tuple[int, str]] = {}
    for k, cell in enumerate(cells):
        for name, tensor in cell.named_buffers():
            first = owner.setdefault(id(tensor), (k, name))
            if first[0] != k:
                raise ValueError(
                    f"balance: buffer {name!r} of cell {k} is shared with {first[1]!r} of cell "
                    f"{first[0]}; a buffer can live in only one cell (keep the layers sharing it "
                    f"in the same cell)"
                )


def _skip_layout(cells: Sequence[nn.Sequential]) -> SkipLayout | None:
    """Where the skippable layers' skips are stashed and popped, found once from the cells
    (None when no skip is stashed and popped)."""
    layout = inspect_skip_layout(cells)
    return layout if layout.routes else None

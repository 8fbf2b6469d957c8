"""FSDP's collectives of a sharded cell on gloo, waited for by the pipe's guard.

FSDP2 waits for its all-gathers and reduce-scatters itself, in gloo, where nothing can end
the wait but the collective or the group's timeout: a replica whose step failed left the
others waiting that long, and a replica that died surfaced as gloo's own "Connection reset by
peer", raised as if the waiting rank's layer had failed. Here each of a unit's collectives is
issued by FSDP's own communication object, asynchronously, and waited for like every other
wait of a step (gpipe_fast/distributed/guard.py): another rank's failure ends it at once, the
timeout bounds it and names the rank that did not answer, and a broken connection names the
rank that died (a PeerFailure, the failure every rank reads).

Only for cells on the CPU: NCCL's collectives do not block the host, which a wait here would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gpipe_fast.distributed.guard import Guard


class _Guarded:
    """One of FSDP's communication objects (`inner`: its allocation and its collective),
    its collective waited for by `guard`; `what` names it in the messages."""

    def __init__(self, inner: Any, guard: Guard, what: str) -> None:
        self.inner = inner
        self.guard = guard
        self.what = what

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)  # type: ignore[no-any-return]

    def _wait(self, work: Any, group: Any) -> None:
        if work is not None:
            self.guard.wait(work, self.what, group=group)


class GuardedAllGather(_Guarded):
    """FSDP's all-gather of a unit's parameters; done when it returns (FSDP then reads the
    result as a synchronous one's)."""

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False
    ) -> None:
        work = self.inner(
            output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=True
        )
        self._wait(work, group)


class GuardedReduceScatter(_Guarded):
    """FSDP's reduce-scatter of a unit's gradients; done when it returns."""

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        work = self.inner(
            output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
            async_op=True,
        )  # fmt: skip
        self._wait(work, group)


def guard_collectives(param_groups: Sequence[Any], guard: Guard, cell: int) -> None:
    """Every collective of these FSDP parameter groups (one unit's) waited for by `guard`
    (a torch without FSDP's communication objects keeps its own waits)."""
    for group in param_groups:
        if hasattr(group, "_all_gather_comm"):
            group._all_gather_comm = GuardedAllGather(
                group._all_gather_comm, guard, f"cell {cell}'s all-gather of its parameters"
            )
        if hasattr(group, "_reduce_scatter_comm"):
            group._reduce_scatter_comm = GuardedReduceScatter(
                group._reduce_scatter_comm, guard, f"cell {cell}'s reduce-scatter of its gradients"
            )

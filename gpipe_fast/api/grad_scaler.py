"""A loss scaler whose inf/NaN verdict every rank of a pipe shares."""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from gpipe_fast.api.gpipe import pipeline_of


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a pipe: use it as in plain PyTorch
    (``scaler.step(opt); scaler.update()``), and pass it to
    ``pipe.train_step(..., grad_scaler=scaler)``, which scales each micro-batch's loss.

    Each rank holds only its cells' gradients, so a plain scaler per rank would decide on
    its own whether the step overflowed: one rank stepping while another skips leaves the
    halves of one model out of step, with different scales. Here the inf/NaN check is agreed
    over the pipe's ``pp_group`` and ``dp_group`` (one all-reduce of one number per
    optimizer and step): when any rank finds one, every rank skips ``step`` and every
    rank's ``update`` lowers the scale alike. ``device`` defaults to the type of the pipe's
    devices; the other keyword arguments are torch's."""

    def __init__(self, pipe: Any, device: str | None = None, **kwargs: Any) -> None:
        if device is None:
            local = [d for d in pipe.devices if d.type != "meta"] or [torch.device("cpu")]
            device = local[0].type
        super().__init__(device, **kwargs)
        self._pipe = pipe

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if self._enabled:
            self._agree(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        # Unscaled here first, so that optimizers that check for inf themselves (fused ones)
        # are handed the agreed verdict too.
        state = self._per_optimizer_states[id(optimizer)]
        if self._enabled and state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def _agree(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank's found_inf becomes 1 when any rank's is."""
        pipeline = pipeline_of(self._pipe)
        groups = pipeline.groups if pipeline is not None else None
        found: dict[torch.device, torch.Tensor] = self._per_optimizer_states[id(optimizer)][
            "found_inf_per_device"
        ]
        assert self._scale is not None  # unscale_ initialised it
        device = groups.device if groups is not None else self._scale.device
        verdict = torch.zeros((), dtype=torch.float32, device=device)
        for flag in found.values():
            verdict += flag.to(device)
        if groups is not None:
            groups.reduce_over_all(verdict, "max")
        verdict.clamp_(max=1.0)  # a flag, however many devices found one
        for flag in found.values():
            flag.copy_(verdict)
        if not found:  # no gradient on this rank: it follows the others' verdict
            found[self._scale.device] = verdict.to(self._scale.device)

"""A model's own save_pretrained on one rank of a pipe warns of the stages it holds stale."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

# What the warning advises: the writers that know which rank holds which stage.
ADVICE = (
    "save the trained model with gpipe_fast.integrations.transformers.save_pretrained(model, "
    "pipe, directory) on every rank (PipelineTrainer.save_model calls it), which writes each "
    "rank's own tensors into one directory that from_pretrained loads (a PEFT adapter "
    "gathered on the first rank)"
)


class StaleSave:
    """Stands in for a module's ``save_pretrained`` on a rank of a pipe across processes:
    warns that the modules other ranks run hold the values they had when the pipe was built
    (their training happened on those ranks), then saves as asked."""

    def __init__(self, save: Callable[..., Any], where: str, stale: list[str]) -> None:
        self.save = save
        self.where = where
        self.stale = stale

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        shown = ", ".join(self.stale[:4]) + (", ..." if len(self.stale) > 4 else "")
        warnings.warn(
            f"gpipe_fast: save_pretrained on {self.where}: the {len(self.stale)} tensor(s) of "
            f"the stages other ranks run ({shown}) are saved with the values they had when "
            f"the pipe was built, not as trained; {ADVICE}",
            UserWarning,
            stacklevel=2,
        )
        return self.save(*args, **kwargs)


def warn_on_rank_saves(model: nn.Module, local: nn.Module, where: str) -> None:
    """Makes each ``save_pretrained`` of `model` and its submodules (transformers' and PEFT's
    models) warn before saving, naming its tensors that `local` (this rank's stages) does
    not hold. Nothing changes for a module without such a method."""
    held = {id(t) for t in (*local.parameters(), *local.buffers())}
    for prefix, module in model.named_modules():
        save = getattr(module, "save_pretrained", None)
        if not callable(save) or isinstance(save, StaleSave):
            continue
        named = (*module.named_parameters(), *module.named_buffers())
        # Trained tensors first: a frozen one of another rank's stage is stale but unchanged.
        stale = [n for n, t in named if id(t) not in held and t.requires_grad]
        stale += [n for n, t in named if id(t) not in held and not t.requires_grad]
        if stale:
            label = f"{type(module).__name__}" + (f" ({prefix})" if prefix else "")
            module.__dict__["save_pretrained"] = StaleSave(save, f"{label}, {where}", stale)

"""A Trainer checkpoint's optimizer state as DCP shards by model names: any layout resumes it."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from gpipe_fast.api.gpipe import GPipe

FOLDER = "optimizer"  # inside checkpoint-<step>/
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def save_optimizer(
    pipe: GPipe, optimizer: torch.optim.Optimizer, checkpoint: str | os.PathLike[str]
) -> None:
    """Writes `optimizer`'s state into checkpoint/optimizer/ (every rank of the job, its
    own shards): each parameter's state and group settings under the model's own name, as
    for the plain model, so another split, pp x dp layout or the plain model resumes it."""
    state = {"optim": get_optimizer_state_dict(pipe, _plain(optimizer), options=FLAT)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process: DCP warns that it saves alone
        save(state, checkpoint_id=str(Path(checkpoint) / FOLDER))


def load_optimizer(
    pipe: GPipe, optimizer: torch.optim.Optimizer, checkpoint: str | os.PathLike[str]
) -> bool:
    """Reads this rank's part of the state `save_optimizer` wrote; False when `checkpoint`
    holds none (a checkpoint of another trainer: the optimizer starts afresh)."""
    folder = Path(checkpoint) / FOLDER
    if not (folder / ".metadata").is_file():
        return False
    optimizer = _plain(optimizer)
    state = {"optim": get_optimizer_state_dict(pipe, optimizer, options=FLAT)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(state, checkpoint_id=str(folder))
    set_optimizer_state_dict(pipe, optimizer, state["optim"], options=FLAT)
    return True


def _plain(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)  # type: ignore[no-any-return]

"""Pretrained safetensors read into a pipe: each rank reads only its own stages' tensors."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from gpipe_fast.api.gpipe import GPipe
from gpipe_fast.integrations.transformers.names import aliases, tie_groups

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
ADAPTER = "adapter_model.safetensors"
LOAD_BYTES = 64 * 2**20  # read, then copied into the stage, this much at a time


def weight_files(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Each tensor's key in a directory saved by ``save_pretrained`` (or ``save_model``) ->
    the safetensors file holding it: from the index of a sharded checkpoint, else the one
    ``model.safetensors``."""
    from safetensors import safe_open

    folder = Path(directory)
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    if (folder / SINGLE).is_file():
        with safe_open(str(folder / SINGLE), framework="pt") as opened:
            return dict.fromkeys(opened.keys(), folder / SINGLE)
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    raise FileNotFoundError(
        f"{folder}: no {INDEX} or {SINGLE} (a directory of save_pretrained in the safetensors "
        f"format; it holds {present or 'nothing'})"
    )


def load_pretrained(pipe: GPipe, directory: str | os.PathLike[str]) -> list[str]:
    """Loads this rank's tensors of ``pipe`` (a :func:`gpipe_fast.pipeline` of a transformers
    model) from ``directory``, a pretrained model's directory (``save_pretrained``'s
    safetensors, sharded with an index or not). Each rank opens only the files that hold its
    stages' tensors and reads only those tensors, so a model built on the meta device and
    pipelined never exists whole on any rank. A weight tied across stages is read under the
    name the directory keeps (GPT-2's head from ``transformer.wte.weight``) by every rank
    holding it. With ``dp_shard`` each replica keeps its shard of what it read.

    Returns this rank's keys the directory lacks (also named in a warning); a tensor built
    on the meta device and left so keeps the pipe from running until it is set."""
    from safetensors import safe_open

    files = weight_files(directory)
    wanted = pipe.state_dict(keep_vars=True)
    others = aliases(tie_groups(pipe))
    found: dict[Path, list[tuple[str, str]]] = {}  # file -> (key in the file, the pipe's key)
    missing = []
    for key in wanted:
        source = next((k for k in (key, *others.get(key, ())) if k in files), None)
        if source is None:
            missing.append(key)
        else:
            found.setdefault(files[source], []).append((source, key))
    values: dict[str, Tensor] = {}
    held = 0
    for path, keys in found.items():
        for source, key in keys:
            # Opened for each tensor: what it maps of the file is let go with the tensor.
            with safe_open(str(path), framework="pt") as opened:
                values[key] = _as_held(opened.get_tensor(source), wanted[key])
            held += values[key].numel() * values[key].element_size()
            if held >= LOAD_BYTES:  # a few tensors at a time beside the stage's own
                _load(pipe, values)
                held = 0
    _load(pipe, values)
    if missing:
        warnings.warn(
            f"gpipe_fast: {directory} holds no values for {len(missing)} tensor(s) of this "
            f"rank's stages: {', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}",
            stacklevel=2,
        )
    return missing


def _load(pipe: GPipe, values: dict[str, Tensor]) -> None:
    """Copies `values` into the pipe's tensors (which counts them as initialised), emptied."""
    with torch.no_grad():
        pipe.load_state_dict(values, strict=False)
    values.clear()


def _as_held(value: Tensor, held: Tensor) -> Tensor:
    """A value read from a file as it fills `held`: as read (loading casts it into the
    tensor's dtype, with no converted copy of it), or for a shard of a sharded stage (a
    DTensor) this rank's shard of it (each replica read the whole)."""
    if isinstance(held, DTensor):
        value = value.to(held.dtype)
        return distribute_tensor(value, held.device_mesh, held.placements, src_data_rank=None)
    return value


def load_adapter(model: nn.Module, pipe: GPipe, directory: str | os.PathLike[str]) -> None:
    """A PEFT adapter saved by ``save_pretrained`` (``adapter_model.safetensors``) loaded into
    ``model`` (the PEFT model ``pipe`` was built from): this rank's stages' modules are the
    pipe's, so each rank's adapter tensors are the ones it trains."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(Path(directory) / ADAPTER))
    local = pipe.state_dict(keep_vars=True)
    device = next(iter(local.values())).device if local else torch.device("cpu")
    with torch.no_grad():
        set_peft_model_state_dict(model, {k: v.to(device) for k, v in weights.items()})

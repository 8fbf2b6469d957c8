"""A pipe's model saved as a transformers model directory, each rank writing what it holds."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from gpipe_fast.api.gpipe import GPipe
from gpipe_fast.integrations.transformers.names import tie_groups
from gpipe_fast.integrations.transformers.pretrained import INDEX, SINGLE

SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def save_pretrained(
    model: nn.Module,
    pipe: GPipe,
    directory: str | os.PathLike[str],
    *,
    processing_class: Any = None,
    max_shard_size: int | str = "50GB",
) -> None:
    """Writes ``model`` (the transformers model ``pipe`` was built from) as trained by the
    pipe into ``directory``, which ``from_pretrained`` then loads in one process: the config
    (and generation config), the weights as safetensors, sharded with an index
    (``model.safetensors.index.json``) when there is more than one file, and
    ``processing_class`` (a tokenizer) when given. Every rank of the pipe calls it.

    Each rank writes only what it holds: the files of its stages' tensors (replicas: the
    first one's; ``dp_shard`` stages are gathered over their replicas, which take part),
    at most ``max_shard_size`` each; a weight tied across stages once, under the name
    ``save_pretrained`` keeps (GPT-2's ``transformer.wte.weight``). The first rank writes
    the config and the index. A PEFT model is saved as its adapter (``adapter_model.safetensors``
    and ``adapter_config.json``), its trainable tensors gathered on the first rank."""
    folder = Path(directory)
    first = _rank_in(pipe.layout.pp_group) == 0 and _rank_in(pipe.layout.dp_group) == 0
    if first:
        folder.mkdir(parents=True, exist_ok=True)
    if _is_peft(model):
        _save_adapter(model, pipe, folder, first)
    else:
        _save_model(model, pipe, folder, first, _shard_bytes(max_shard_size))
        if first:
            _save_config(model, folder)
    if first and processing_class is not None:
        processing_class.save_pretrained(str(folder))
    _barrier(pipe)


def _save_model(model: nn.Module, pipe: GPipe, folder: Path, first: bool, limit: int) -> None:
    """The weights: this rank's files, then (first rank) the index over every rank's."""
    from safetensors.torch import save_file

    named = _kept_names(model, pipe)
    mine: dict[str, str] = {}  # name written -> this rank's key holding it
    for key in pipe.state_dict(keep_vars=True):
        mine.setdefault(named.get(key, key), key)
    for ignored in getattr(model, "_keys_to_ignore_on_save", None) or ():
        mine.pop(ignored, None)
    local = pipe.state_dict(keep_vars=True)
    sizes = [(name, _nbytes(local[key])) for name, key in mine.items()]
    ranks = _gather(pipe.layout.pp_group, sizes)
    written: set[str] = set()
    plans: list[list[list[str]]] = []  # per pipeline rank: its files, each a list of names
    for rank_sizes in ranks:
        files: list[list[str]] = []
        used = limit
        for name, size in rank_sizes:
            if name in written:
                continue  # held by an earlier rank (a tie across stages): written there
            written.add(name)
            if not files or used + size > limit:
                files.append([])
                used = 0
            files[-1].append(name)
            used += size
        plans.append(files)
    count = sum(map(len, plans))
    names = [SINGLE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors"
                                         for i in range(1, count + 1)]  # fmt: skip
    position = _rank_in(pipe.layout.pp_group)
    start = sum(len(files) for files in plans[:position])
    writer = _rank_in(pipe.layout.dp_group) == 0
    for offset, file_names in enumerate(plans[position]):
        shard = {name: _whole(local[mine[name]]) for name in file_names}  # replicas take part
        if writer:
            save_file(shard, str(folder / names[start + offset]), metadata={"format": "pt"})
    if not first:
        return
    for stale in folder.iterdir():  # an earlier save's files that this one does not replace
        if (SHARD.fullmatch(stale.name) or stale.name in (SINGLE, INDEX)) and (
            stale.name not in names
        ):
            stale.unlink()
    if count > 1:
        weight_map = {
            name: names[sum(len(f) for f in plans[:r]) + i]
            for r, files in enumerate(plans)
            for i, file_names in enumerate(files)
            for name in file_names
        }
        total = sum(size for rank_sizes in ranks for name, size in rank_sizes
                    if weight_map.get(name) is not None)  # fmt: skip
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _save_config(model: Any, folder: Path) -> None:
    """The config as save_pretrained writes it (architectures, dtype), the generation config."""
    config: Any = getattr(model, "config", None)
    if config is None:
        return
    config.architectures = [type(model).__name__]
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        config.dtype = str(dtype).split(".")[1]
    config.save_pretrained(str(folder))
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate():
        model.generation_config.save_pretrained(str(folder))


def _save_adapter(model: Any, pipe: GPipe, folder: Path, first: bool) -> None:
    """A PEFT model's adapter: every rank's trainable tensors, gathered on the first rank,
    which writes them with PEFT's own save_pretrained (called on its class: the model's
    own method warns on a pipe across processes)."""
    trainable = {name: _whole(p).cpu() for name, p in pipe.named_parameters() if p.requires_grad}
    merged: dict[str, Tensor] = {}
    for part in _gather(pipe.layout.pp_group, trainable):
        merged.update(part)
    if first:
        type(model).save_pretrained(model, str(folder), state_dict=merged)


def _kept_names(model: nn.Module, pipe: GPipe) -> dict[str, str]:
    """Each tied key -> the name save_pretrained keeps for its tensor: the one transformers
    does not declare tied (``_tied_weights_keys``), so from_pretrained ties the others to it."""
    from transformers.modeling_utils import _get_tied_weight_keys

    patterns = _get_tied_weight_keys(model)
    named = {}
    for group in tie_groups(pipe, model):
        free = [k for k in sorted(group) if not any(re.search(p, k) for p in patterns)]
        kept = free[0] if free else sorted(group)[-1]
        named.update(dict.fromkeys(group, kept))
    return named


def _whole(tensor: Tensor) -> Tensor:
    """A tensor to write: detached, contiguous, on the CPU; a shard gathered whole (a
    collective of its replicas)."""
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.cpu().contiguous()


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _shard_bytes(size: int | str) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    return int(convert_file_size_to_int(size))


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def _rank_in(group: Any) -> int:
    if group is None:
        return 0
    if hasattr(group, "get_group"):  # a one-dimensional DeviceMesh
        group = group.get_group()
    return int(dist.get_rank(group))


def _gather(group: Any, value: Any) -> list[Any]:
    """`value` of every rank of the pipeline group, in its order (this one's alone without)."""
    if group is None:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def _barrier(pipe: GPipe) -> None:
    """Every rank of the pipe returns once every file is written."""
    for group in (pipe.layout.pp_group, pipe.layout.dp_group):
        if group is not None:
            dist.barrier(group=group.get_group() if hasattr(group, "get_group") else group)

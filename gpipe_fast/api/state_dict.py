"""A pipe's state dict in the wrapped module's own keys, whichever cell (or rank) holds a layer.

A pipe of an nn.Sequential keys a tensor by its layer's name and its name in the layer. A pipe
of any model (gf.pipeline) has one layer per cell, a stage whose submodules sit at their places
in the model: its layer names are *transparent* (left out of keys), so a key is the model's own,
and a tensor of several stages (a tied weight) is loaded into each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn


def register(module: nn.Module) -> None:
    """Installs the hooks on `module`, a GPipe (it has `_cell_of`, `_layer_names` and
    `_unfilled`)."""
    module._register_state_dict_hook(_strip_cell_prefix)
    module._register_load_state_dict_pre_hook(_add_cell_prefix, with_module=True)
    module.register_load_state_dict_post_hook(_name_keys_as_the_model)


class Cells(nn.ModuleList):
    """The pipe's cells, as torchgpipe's ``partitions``: an nn.ModuleList of nn.Sequential,
    whose indices torch.distributed.checkpoint leaves out of its fully qualified names (see
    GPipe._fqn_modifiers)."""

    def _fqn_modifiers(self) -> dict[str, str]:
        # torch.distributed.checkpoint.state_dict's hook for a module whose state_dict keys
        # leave a level out: the cell index is not part of the model's keys.
        return {str(k): str(k) for k in range(len(self))}


class LayersByName:
    """This process's layers by their name in the model, for torch.distributed.checkpoint's
    walk along a key (a cell index and a layer name may both be "1": not the cells')."""

    def __init__(self, cells: Cells) -> None:
        self._cells = cells

    def __getattr__(self, name: str) -> nn.Module:
        for cell in self._cells:
            if name in cell._modules:
                return cell._modules[name]  # type: ignore[return-value]
        raise AttributeError(name)


class MergedStages:
    """The model's modules by their own names across this process's stages (transparent
    layers), for torch.distributed.checkpoint's walk along a key: a name that several stages
    hold as containers ("model", "model.layers") is a merged view of them."""

    def __init__(self, holders: Iterable[nn.Module]) -> None:
        self._holders = list(holders)

    def __getattr__(self, name: str) -> Any:
        found = [m for h in self._holders if (m := h._modules.get(name)) is not None]
        if not found:  # a tensor a container holds (a stage's copy of a glue parameter)
            tensors = [h._parameters.get(name, h._buffers.get(name)) for h in self._holders]
            tensors = [t for t in tensors if t is not None]
            if tensors:
                return tensors[0]
            raise AttributeError(name)
        if len({id(m) for m in found}) == 1:
            return found[0] if type(found[0]) is not nn.Module else MergedStages(found)
        return MergedStages(found)


def model_key(key: str, prefix: str, transparent: bool = False) -> str:
    """A key under the pipe ("partitions.<cell>.<layer>...") as the model's ("<layer>...", or
    with transparent layers "..."): the model's own."""
    if not key.startswith(prefix + "partitions."):
        return key
    rest = key[len(prefix) + len("partitions.") :].split(".", 1)[1]
    return prefix + (rest.split(".", 1)[1] if transparent else rest)


def cell_keys(cells: Iterable[tuple[int, nn.Module]]) -> dict[str, list[str]]:
    """With transparent layers: each model key of `cells` ((position, cell) pairs) -> its
    keys under "partitions." (several when several stages hold the tensor)."""
    keys: dict[str, list[str]] = {}
    for position, cell in cells:
        for key in cell.state_dict(keep_vars=True):
            layer, _, name = key.partition(".")
            keys.setdefault(name, []).append(f"{position}.{layer}.{name}")
    return keys


def _strip_cell_prefix(module: Any, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    for key in list(state):
        renamed = model_key(key, prefix, module._transparent_layers)
        if renamed != key:
            state[renamed] = state.pop(key)


def _add_cell_prefix(module: Any, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """The model's own keys to the cells' (a checkpoint of torchgpipe's, already in cell keys,
    passes as it is); keys of layers that other processes run are skipped, so the whole
    model's state dict loads on every rank; loaded tensors count as initialised."""
    loaded = set()
    for key in list(state):
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if module._transparent_layers:
            targets = module._cell_keys.get(name)
            if targets:
                value = state.pop(key)
                for target in targets:  # a tied tensor is loaded into every stage holding it
                    state[f"{prefix}partitions.{target}"] = value
                loaded.add(name)
            elif name in module._layer_names:
                del state[key]  # a tensor of another process's stages
            continue
        layer = name.split(".", 1)[0]
        cell = module._cell_of.get(layer)
        if cell is not None:
            state[f"{prefix}partitions.{cell}.{name}"] = state.pop(key)
            loaded.add(name)
        elif layer in module._layer_names:
            del state[key]  # a layer of another process's cells
    module._unfilled.loaded(loaded)


def _name_keys_as_the_model(module: Any, incompatible: Any) -> None:
    """Missing keys in the model's own names (the error lists them), not the cells'."""
    for i, key in enumerate(incompatible.missing_keys):
        head, found, rest = key.partition("partitions.")
        if module._transparent_layers:
            if found:
                incompatible.missing_keys[i] = model_key(key, head, True)
            continue
        cell, _, name = rest.partition(".")
        layer = name.split(".", 1)[0]
        if found and (not head or head.endswith(".")) and str(module._cell_of.get(layer)) == cell:
            incompatible.missing_keys[i] = head + name

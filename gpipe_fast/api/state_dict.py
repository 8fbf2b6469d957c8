"""A pipe's state dict in the wrapped module's own keys, whichever cell (or rank) holds a layer.

The keys are its Naming's (api/naming.py): the model's own, with or without layer names.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn

from gpipe_fast.api.naming import Naming

NamingOf = Callable[[Any], Naming]  # a pipe's current naming (a re-cut pipe gets a new one)
Loaded = Callable[[Any, set[str]], None]  # told the model keys a load filled in a pipe


def register(module: nn.Module, naming_of: NamingOf, loaded: Loaded) -> None:
    """Installs the hooks on `module`, a pipe whose keys `naming_of(module)` names; a load
    tells `loaded(module, keys)` which keys it filled."""
    module._register_state_dict_hook(partial(_strip_cell_prefix, naming_of))
    module._register_load_state_dict_pre_hook(
        partial(_add_cell_prefix, naming_of, loaded), with_module=True
    )
    module.register_load_state_dict_post_hook(partial(_name_keys_as_the_model, naming_of))


class Cells(nn.ModuleList):
    """The pipe's cells, as torchgpipe's ``partitions``: an nn.ModuleList of nn.Sequential,
    whose indices torch.distributed.checkpoint leaves out of its fully qualified names (see
    GPipe._fqn_modifiers)."""

    def _fqn_modifiers(self) -> dict[str, str]:
        # torch.distributed.checkpoint.state_dict's hook for a module whose state_dict keys
        # leave a level out: the cell index is not part of the model's keys.
        return {str(k): str(k) for k in range(len(self))}


def _strip_cell_prefix(
    naming_of: NamingOf, module: Any, state: dict[str, Any], prefix: str, _meta: Any
) -> None:
    naming = naming_of(module)
    for key in list(state):
        renamed = naming.model_key(key, prefix)
        if renamed != key:
            state[renamed] = state.pop(key)


def _add_cell_prefix(
    naming_of: NamingOf,
    loaded_into: Loaded,
    module: Any,
    state: dict[str, Any],
    prefix: str,
    *_: Any,
) -> None:
    """The model's own keys to the cells' (a checkpoint of torchgpipe's, already in cell keys,
    passes as it is); keys of layers that other processes run are skipped, so the whole
    model's state dict loads on every rank; loaded tensors count as initialised."""
    naming = naming_of(module)
    loaded = set()
    for key in list(state):
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if naming.transparent:
            targets = naming.cell_keys.get(name)
            if targets:
                value = state.pop(key)
                for target in targets:  # a tied tensor is loaded into every stage holding it
                    state[f"{prefix}partitions.{target}"] = value
                loaded.add(name)
            elif name in naming.layer_names:
                del state[key]  # a tensor of another process's stages
            continue
        layer = name.split(".", 1)[0]
        cell = naming.cell_of.get(layer)
        if cell is not None:
            state[f"{prefix}partitions.{cell}.{name}"] = state.pop(key)
            loaded.add(name)
        elif layer in naming.layer_names:
            del state[key]  # a layer of another process's cells
    loaded_into(module, loaded)


def _name_keys_as_the_model(naming_of: NamingOf, module: Any, incompatible: Any) -> None:
    """Missing keys in the model's own names (the error lists them), not the cells'."""
    naming = naming_of(module)
    for i, key in enumerate(incompatible.missing_keys):
        head, found, rest = key.partition("partitions.")
        if naming.transparent:
            if found:
                incompatible.missing_keys[i] = naming.model_key(key, head)
            continue
        cell, _, name = rest.partition(".")
        layer = name.split(".", 1)[0]
        if found and (not head or head.endswith(".")) and str(naming.cell_of.get(layer)) == cell:
            incompatible.missing_keys[i] = head + name

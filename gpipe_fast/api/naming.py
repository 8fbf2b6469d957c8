"""The model's own names for a pipe's layers, parameters, buffers and state-dict keys."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from torch import Tensor, nn

TensorT = TypeVar("TensorT", bound=Tensor)  # a parameter or a buffer


class LayersByName:
    """This process's layers by their name in the model, for torch.distributed.checkpoint's
    walk along a key (a cell index and a layer name may both be "1": not the cells')."""

    def __init__(self, cells: Iterable[nn.Module]) -> None:
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


def place_key(name: str, transparent: bool) -> str:
    """A tensor's name in its cell ("<layer>.<name>") as the model's key: with transparent
    layers the layer (a stage) is left out, as in state_dict()."""
    return name.split(".", 1)[1] if transparent else name


@dataclass
class Naming:
    """How a pipe names what its cells hold by the model's own names. A pipe of an
    nn.Sequential keys a tensor by its layer's name and its name in the layer; a pipe of any
    model (gf.pipeline) has one layer per cell, a stage whose submodules sit at their places
    in the model: its layer names are *transparent* (left out of keys), so a key is the
    model's own, and a tensor of several stages (a tied weight) is loaded into each."""

    transparent: bool  # layers left out of keys (a pipe of any model's stages)
    # Layer name in the original module -> position among this process's cells, so that
    # state_dict keeps the original keys (and, across processes, holds these cells only).
    cell_of: dict[str, int]
    # Every layer's name (with transparent layers: every model key), so that loading the
    # whole model's state dict on one rank skips the other ranks' but still refuses keys of
    # no layer at all.
    layer_names: set[str]
    # With transparent layers: each model key of this process's cells -> its cell keys.
    cell_keys: dict[str, list[str]]
    layers_by_name: LayersByName  # torch.distributed.checkpoint's walk, one name per layer
    merged_stages: MergedStages | None  # the same with transparent layers

    @classmethod
    def of(
        cls,
        layer_names: Iterable[str],
        cells: Sequence[nn.Module],
        local: Sequence[nn.Module],
        transparent: bool,
    ) -> Naming:
        """The names of a pipe whose module's layers are `layer_names`, cut into `cells`, of
        which this process holds `local` (in the order of its partitions)."""
        naming = cls(
            transparent=transparent,
            cell_of={name: k for k, cell in enumerate(local) for name in cell._modules},
            layer_names=set(layer_names),
            cell_keys={},
            layers_by_name=LayersByName(local),
            merged_stages=None,
        )
        if transparent:  # keys are the model's own: every cell's, and local ones'
            naming.layer_names = set(cell_keys(enumerate(cells)))
            naming.cell_keys = cell_keys(enumerate(local))
            naming.merged_stages = MergedStages(
                layer for cell in local for layer in cell.children()
            )
            for cell in local:  # torch.distributed.checkpoint leaves the stage's name out
                # (of a dict, copied at each call: a generator would be spent by the first)
                cell.__dict__["_fqn_modifiers"] = partial(dict, {n: n for n in cell._modules})
        return naming

    def place_key(self, name: str) -> str:
        """A tensor's name in its cell ("<layer>.<name>") as the model's key."""
        return place_key(name, self.transparent)

    def model_key(self, key: str, prefix: str = "") -> str:
        """A key under the pipe ("<prefix>partitions.<cell>.<layer>...") as the model's."""
        return model_key(key, prefix, self.transparent)

    def model_names(
        self, named: Iterator[tuple[str, TensorT]], prefix: str
    ) -> Iterator[tuple[str, TensorT]]:
        """`named` (the pipe's own named_parameters() or named_buffers()) by the model's
        names."""
        dot = f"{prefix}." if prefix else ""
        for name, tensor in named:
            yield self.model_key(name, dot), tensor

    def fqn_modifiers(self, partitions: Iterable[nn.Module]) -> dict[str, str]:
        """torch.distributed.checkpoint.state_dict's hook for modules whose state_dict keys
        leave levels out: "partitions" and the cell index are left out of a layer's fully
        qualified name, and a key's layer name is looked up among the layers (the pipe's
        attributes `_layers_by_name` and `_merged_stages`, this naming's)."""
        if self.transparent:  # a model key's first name, among the stages' modules
            tops = {name for cell in partitions for layer in cell.children()
                    for name in layer._modules}  # fmt: skip
            return {"partitions": "partitions", **dict.fromkeys(tops, "_merged_stages")}
        return {"partitions": "partitions", **dict.fromkeys(self.cell_of, "_layers_by_name")}

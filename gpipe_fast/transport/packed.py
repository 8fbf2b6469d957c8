"""A pytree between processes: its tensors, then its structure and other leaves, pickled."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree


class _Slot:
    """A leaf's place in a pickled structure (pickled by name: one object)."""

    def __reduce__(self) -> str:
        return "SLOT"


SLOT = _Slot()

# A structure repeats at every micro-batch: it is pickled once (as the pytree itself with a
# SLOT for every leaf: user containers pickle fast, torch's TreeSpec neither fast nor without
# warnings) and kept on both sides, by spec and by bytes. Bounded: cleared when full (a
# program's boundaries have few structures).
_CACHE_SIZE = 256
_structures: dict[pytree.TreeSpec, bytes] = {}
_specs: dict[bytes, pytree.TreeSpec] = {}


class Packed(tuple):  # type: ignore[type-arg]
    """A pytree's message entries: its tensor leaves in order, then a uint8 tensor holding
    its structure and other leaves pickled (a wire header of form TREE describes them)."""

    __slots__ = ()


def pack(value: Any) -> Packed:
    """`value`, any pytree, as the entries of one message; TypeError naming the leaves'
    types when it cannot be pickled."""
    leaves, spec = pytree.tree_flatten(value)
    structure = _structures.get(spec)
    if structure is None:
        skeleton = pytree.tree_unflatten([SLOT] * len(leaves), spec)
        structure = _pickled(skeleton, value, "its structure")
        _remember(_structures, spec, structure)
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
    others = [SLOT if isinstance(leaf, Tensor) else leaf for leaf in leaves]
    blob = _pickled((structure, others), value, "its leaves")
    return Packed((*tensors, torch.frombuffer(bytearray(blob), dtype=torch.uint8)))


def unpack(entries: Sequence[Tensor | None]) -> Any:
    """The pytree whose Packed entries were received (tensors, then the pickled rest)."""
    *tensors, blob = entries
    assert blob is not None, "a packed pytree ends with its pickled structure"
    structure, others = pickle.loads(blob.cpu().numpy().tobytes())
    spec = _specs.get(structure)
    if spec is None:
        spec = pytree.tree_structure(pickle.loads(structure))
        _remember(_specs, structure, spec)
    given = iter(tensors)
    return pytree.tree_unflatten([next(given) if leaf is SLOT else leaf for leaf in others], spec)


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _CACHE_SIZE:
        cache.clear()
    cache[key] = value


def _pickled(obj: Any, value: Any, what: str) -> bytes:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        leaves = ", ".join(
            sorted({type(leaf).__name__ for leaf in pytree.tree_leaves(value)} - {"Tensor"})
        )
        raise TypeError(
            f"a value sent to another process holds what cannot be pickled ({what}: {error}); "
            "between processes a cell's output must be a pytree of tensors and picklable "
            f"values (this one's other leaves are: {leaves or 'none'})"
        ) from error

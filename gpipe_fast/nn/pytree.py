"""A value between cells as a pytree: its tensor leaves taken out and put back in order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from torch.utils import _pytree as pytree

# What a cell takes and returns: any pytree (as torch.utils._pytree flattens it: tuples,
# lists, dicts, namedtuples, ...) whose leaves are tensors and other values (None, ints,
# floats, bools, strings, ...). Its tensors are its tensor leaves, in flattening order. A
# lone Tensor and a plain tuple of Tensors (or None), the common cases, never go through
# the pytree functions: a flatten costs microseconds, on every task.
Tree = Any


# The checks below are loops, not all(): they run on every task.


def _flat(value: object) -> bool:
    """A plain tuple (not a namedtuple) of Tensors and None only."""
    if type(value) is not tuple:
        return False
    for t in value:
        if t is not None and not isinstance(t, Tensor):
            return False
    return True


def is_plain(value: object) -> bool:
    """A lone Tensor or a plain tuple of Tensors: no leaf but tensors, no structure but
    the tuple."""
    if isinstance(value, Tensor):
        return True
    if type(value) is not tuple:
        return False
    for t in value:
        if not isinstance(t, Tensor):
            return False
    return True


def tensors_of(value: Tree) -> tuple[Tensor, ...]:
    """The tensor leaves of `value`, in order."""
    if isinstance(value, Tensor):
        return (value,)
    if is_plain(value):
        return value  # type: ignore[no-any-return]
    if _flat(value):
        return tuple([t for t in value if t is not None])
    return tuple(leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, Tensor))


def with_tensors(value: Tree, tensors: Sequence[Tensor | None]) -> Tree:
    """`value` with its tensor leaves replaced, in order, by `tensors` (as many)."""
    if isinstance(value, Tensor):
        return tensors[0]
    if is_plain(value):
        return tuple(tensors)
    given = iter(tensors)
    if _flat(value):
        return tuple([None if t is None else next(given) for t in value])
    leaves, spec = pytree.tree_flatten(value)
    return pytree.tree_unflatten(
        [next(given) if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec
    )


def map_tensors(function: Callable[[Tensor], Tensor], value: Tree) -> Tree:
    """`value` with `function` applied to each tensor leaf (other leaves kept)."""
    if isinstance(value, Tensor):
        return function(value)
    if _flat(value):
        return tuple([None if t is None else function(t) for t in value])
    leaves, spec = pytree.tree_flatten(value)
    return pytree.tree_unflatten(
        [function(leaf) if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec
    )


def leaf_names(value: Tree, what: str) -> list[str]:
    """Per tensor leaf of `value`, its name in an error message: `what` followed by its
    path (output['h'], output[1].pos), or what[i] for the i-th of a lone tensor or a plain
    tuple."""
    if is_plain(value):
        return [f"{what}[{i}]" for i in range(len(tensors_of(value)))]
    paths, _ = pytree.tree_flatten_with_path(value)
    return [f"{what}{pytree.keystr(path)}" for path, leaf in paths if isinstance(leaf, Tensor)]

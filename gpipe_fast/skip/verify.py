"""``verify_skippables``: every skip stashed once and popped once, later, in a Sequential."""

from __future__ import annotations

from torch import nn

from gpipe_fast.skip.namespace import Namespace
from gpipe_fast.skip.skippable import Skippable

__all__ = ["verify_skippables"]


def verify_skippables(module: nn.Sequential) -> None:
    """Checks that the skippable layers among ``module``'s children pair up: each skip
    (namespace, name) stashed by exactly one layer and popped by exactly one later layer.

    Raises :exc:`TypeError` listing every problem, one line each, with the layer's name in
    ``module``::

        one or more pairs of stash and pop do not match:

        * '1' redeclared 'foo' as stashable but not isolated by namespace
        * '3' declared 'bar' as poppable but it was not stashed

    Only direct children are checked, as a pipe partitions only those. To use a name
    twice, isolate each pair in its own :class:`Namespace` (:meth:`Skippable.isolate`).
    """
    stashed_by: dict[tuple[Namespace | None, str], str] = {}
    popped: set[tuple[Namespace | None, str]] = set()
    pops_before: dict[tuple[Namespace | None, str], list[str]] = {}
    msgs: list[str] = []

    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue

        both = layer.stashable_names & layer.poppable_names
        for name in sorted(both):
            msgs.append(f"'{layer_name}' declared '{name}' both as stashable and as poppable")

        for ns, name in layer.stashable():
            if name in both:
                continue
            key = (ns, name)
            if key in stashed_by:
                msgs.append(
                    f"'{layer_name}' redeclared '{name}' as stashable but not isolated by namespace"
                )
                continue
            stashed_by[key] = layer_name
            for pop_layer in pops_before.get(key, []):
                msgs.append(
                    f"'{pop_layer}' declared '{name}' as poppable but it was not stashed: "
                    f"it is stashed after it, by '{layer_name}'; a pop must follow its stash"
                )

        for ns, name in layer.poppable():
            if name in both:
                continue
            key = (ns, name)
            if key in popped:
                msgs.append(
                    f"'{layer_name}' redeclared '{name}' as poppable but not isolated by namespace"
                )
                continue
            if key not in stashed_by:
                pops_before.setdefault(key, []).append(layer_name)
                continue
            popped.add(key)

    # Pops of names never stashed at all (those stashed later were reported above).
    for key, pop_layers in pops_before.items():
        if key not in stashed_by:
            for pop_layer in pop_layers:
                msgs.append(f"'{pop_layer}' declared '{key[1]}' as poppable but it was not stashed")
    for key in stashed_by:
        if key not in popped and key not in pops_before:
            msgs.append(f"no module declared '{key[1]}' as poppable but stashed")

    if msgs:
        raise TypeError(
            "one or more pairs of stash and pop do not match:\n\n"
            + "\n".join(f"* {msg}" for msg in msgs)
        )

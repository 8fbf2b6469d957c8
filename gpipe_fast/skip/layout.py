"""Which skips cross cells of a pipe, and which stay inside one: ``inspect_skip_layout``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from gpipe_fast.skip.namespace import Namespace
from gpipe_fast.skip.skippable import Skippable
from gpipe_fast.skip.tracker import SkipKey

__all__ = ["SkipLayout", "SkipRoute", "inspect_skip_layout"]


@dataclass(frozen=True)
class SkipRoute:
    """One skip: stashed in cell ``stash_cell``, popped in cell ``pop_cell`` (>= it)."""

    ns: Namespace | None
    name: str
    stash_cell: int
    pop_cell: int

    @property
    def key(self) -> SkipKey:
        """(namespace, name): how trackers and layer declarations name the skip."""
        return (self.ns, self.name)

    @property
    def crosses(self) -> bool:
        """Whether the skip leaves its cell (the runtime must carry it)."""
        return self.pop_cell != self.stash_cell


class SkipLayout:
    """The skips of a model cut into cells, for a pipe runtime to query per cell.

    Keys are (namespace, name). Per cell, :meth:`sends` lists the skips stashed there
    and popped in a later cell (the runtime takes them from the cell's tracker after its
    forward and carries them on), :meth:`receives` those stashed in an earlier cell and
    popped there (the runtime hands them to the cell's tracker before its forward), and
    :meth:`passes` those that skip over the cell (stashed before it, popped after it),
    which a runtime forwarding cell to cell must relay. Lists follow the stash cell, then
    the order of stashes in the model.
    """

    def __init__(self, num_cells: int, routes: Iterable[SkipRoute]) -> None:
        self.num_cells = num_cells
        self.routes: list[SkipRoute] = list(routes)
        self._by_key = {route.key: route for route in self.routes}

    def __repr__(self) -> str:
        return f"SkipLayout(num_cells={self.num_cells}, routes={self.routes!r})"

    def route(self, ns: Namespace | None, name: str) -> SkipRoute | None:
        """The route of skip (ns, name), None when no stash/pop pair of it was found."""
        return self._by_key.get((ns, name))

    def crossing(self) -> list[SkipRoute]:
        """The skips popped in a later cell than the one that stashed them."""
        return [route for route in self._sorted() if route.crosses]

    def inside(self) -> list[SkipRoute]:
        """The skips stashed and popped in the same cell: the runtime has nothing to do."""
        return [route for route in self._sorted() if not route.crosses]

    def sends(self, cell: int) -> list[SkipKey]:
        """Keys of the skips that cell ``cell`` stashes for later cells."""
        return [r.key for r in self._sorted() if r.crosses and r.stash_cell == cell]

    def receives(self, cell: int) -> list[SkipKey]:
        """Keys of the skips that cell ``cell`` pops from earlier cells."""
        return [r.key for r in self._sorted() if r.crosses and r.pop_cell == cell]

    def pairs(self) -> dict[tuple[int, int], list[SkipKey]]:
        """The crossing skips grouped by (stash cell, pop cell), each group's keys in the
        layout's order: what a runtime carries as one transfer per pair and micro-batch."""
        grouped: dict[tuple[int, int], list[SkipKey]] = {}
        for route in self.crossing():
            grouped.setdefault((route.stash_cell, route.pop_cell), []).append(route.key)
        return grouped

    def passes(self, cell: int) -> list[SkipKey]:
        """Keys of the skips stashed before cell ``cell`` and popped after it."""
        return [r.key for r in self._sorted() if r.stash_cell < cell < r.pop_cell]

    def requires_copy(self, ns: Namespace | None, name: str) -> bool:
        """Whether skip (ns, name) crosses cells (torchgpipe's name for it)."""
        route = self.route(ns, name)
        return route is not None and route.crosses

    def copy_policy(self, next_j: int) -> Iterator[tuple[int, Namespace | None, str]]:
        """(stash cell, namespace, name) of each skip that cell ``next_j`` receives,
        as torchgpipe's ``SkipLayout.copy_policy`` yields them."""
        for route in self._sorted():
            if route.crosses and route.pop_cell == next_j:
                yield (route.stash_cell, route.ns, route.name)

    def _sorted(self) -> list[SkipRoute]:
        # Stable on the stash order kept in self.routes; never compares namespaces.
        return sorted(self.routes, key=lambda route: route.stash_cell)


def inspect_skip_layout(partitions: Sequence[Iterable[nn.Module]]) -> SkipLayout:
    """The :class:`SkipLayout` of a model cut into ``partitions`` (cell k's layers, e.g.
    an ``nn.Sequential`` each), looking at the skippable layers among their direct
    children, in order.

    Raises :exc:`TypeError` for a pop with no earlier stash of its (namespace, name);
    a stash never popped gets no route (:func:`verify_skippables` reports both).
    """
    stashed_at: dict[SkipKey, int] = {}
    order: list[SkipKey] = []
    pops: dict[SkipKey, int] = {}
    for cell, partition in enumerate(partitions):
        for layer in partition:
            if not isinstance(layer, Skippable):
                continue
            for key in layer.stashable():
                if key not in stashed_at:
                    order.append(key)
                stashed_at[key] = cell
            for key in layer.poppable():
                if key not in stashed_at:
                    raise TypeError(
                        f"cell {cell} pops '{key[1]}' but no earlier layer stashes it "
                        "(check the model with verify_skippables)"
                    )
                pops[key] = cell
    routes = [SkipRoute(key[0], key[1], stashed_at[key], pops[key]) for key in order if key in pops]
    return SkipLayout(len(partitions), routes)

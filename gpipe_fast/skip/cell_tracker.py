"""The tracker a pipe installs per (cell, micro-batch): it carries skips between cells."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from gpipe_fast.skip.layout import SkipLayout
from gpipe_fast.skip.namespace import Namespace
from gpipe_fast.skip.tracker import SkipKey, SkipTracker

__all__ = ["CellSkipTracker"]


class CellSkipTracker(SkipTracker):
    """The tracker of one (cell, micro-batch) of a pipe: what the runtime installs.

    ``received`` holds the skips stashed in earlier cells and popped in this one (the
    runtime fills it with what those cells sent, keyed by (namespace, name));
    ``layout.receives(cell)`` lists the keys to expect. After the cell's forward,
    ``outgoing`` holds the skips stashed in this cell and popped in a later one, the keys
    of ``layout.sends(cell)``: the runtime sends them on with the micro-batch (to the
    popping cell, directly or through the cells in between) and returns their gradients
    in backward. Skips stashed and popped inside the cell stay in ``tensors``, as in the
    base class.

    A cell's recomputation (checkpointing) runs under a fresh tracker with the same
    ``received``: its pops get the same tensors again, and its ``outgoing`` must be
    dropped, not sent twice.

    With ``cut=True`` (a forward run layer by layer with the graph cut between layers, as
    the split backward of zero bubble needs) a skip is cut at its layers too: a skip
    stashed and popped inside the cell is popped as a detached leaf of the stashed tensor,
    and :meth:`take_layer` tells, after each layer, the (key, leaf) pairs it popped and
    the (key, tensor) pairs it stashed (None skips left out), which are extra inputs and
    outputs of that layer's piece of graph.
    """

    def __init__(
        self,
        layout: SkipLayout,
        cell: int,
        received: Mapping[SkipKey, Tensor | None] | None = None,
        *,
        cut: bool = False,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.cell = cell
        self.received: dict[SkipKey, Tensor | None] = dict(received or {})
        self.outgoing: dict[SkipKey, Tensor | None] = {}
        self.cut = cut
        self.layer_popped: list[tuple[SkipKey, Tensor]] = []
        self.layer_stashed: list[tuple[SkipKey, Tensor]] = []
        self._sends = set(layout.sends(cell))
        self._receives = set(layout.receives(cell))
        # Cut only the skips of the cell's own layers (a skippable layer nested deeper keeps
        # its skip inside its layer's piece of graph).
        self._cut = {route.key for route in layout.routes} if cut else set()

    def save(self, ns: Namespace | None, name: str, tensor: Tensor | None) -> None:
        key = (ns, name)
        cut = key in self._cut and isinstance(tensor, Tensor)
        if cut:
            self.layer_stashed.append((key, tensor))  # type: ignore[arg-type]
        if key in self._sends:
            if tensor is not None and not isinstance(tensor, Tensor):
                # Only boundary values may be pytrees: a skip travels as one tensor.
                raise TypeError(
                    f"skip {name!r} stashed in cell {self.cell} is a {type(tensor).__name__}: "
                    "a skip popped in another cell must be a Tensor or None (inside one "
                    "cell it may hold anything; pass other values along the cells' outputs)"
                )
            self.outgoing[key] = tensor
        elif cut and isinstance(tensor, Tensor):
            super().save(ns, name, tensor.detach().requires_grad_(tensor.requires_grad))
        else:
            super().save(ns, name, tensor)

    def load(self, ns: Namespace | None, name: str) -> Tensor | None:
        key = (ns, name)
        tensor = self.received.pop(key) if key in self._receives else super().load(ns, name)
        if key in self._cut and isinstance(tensor, Tensor):
            self.layer_popped.append((key, tensor))
        return tensor

    def take_layer(self) -> tuple[list[tuple[SkipKey, Tensor]], list[tuple[SkipKey, Tensor]]]:
        """(popped, stashed) by the layer that just ran (``cut=True``), then forgotten."""
        popped, stashed = self.layer_popped, self.layer_stashed
        self.layer_popped, self.layer_stashed = [], []
        return popped, stashed

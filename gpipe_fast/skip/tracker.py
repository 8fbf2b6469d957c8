"""The skip tracker: where a stashed skip waits for its pop, one per thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import Tensor

from gpipe_fast.skip.namespace import Namespace

if TYPE_CHECKING:
    from gpipe_fast.skip.layout import SkipLayout

__all__ = ["CellSkipTracker", "SkipKey", "SkipTracker", "current_skip_tracker", "use_skip_tracker"]

SkipKey = tuple[Namespace | None, str]
"""A skip's identity: (namespace, name); the namespace ``None`` is the default one."""


class SkipTracker:
    """Holds stashed skips until a later layer pops them.

    A skippable layer talks to the tracker of its thread (:func:`current_skip_tracker`)
    through two hooks, and only through them:

    ``save(ns, name, tensor)``, hook (a), hands a stashed skip over. A layer calls it
    once per declared stash name at the end of its ``forward``, after the forward
    succeeded (a forward that raises saves nothing). ``tensor`` is the very object the
    layer stashed (a tensor, still attached to the autograd graph, or ``None``).

    ``load(ns, name)``, hook (b), supplies a skip to pop. A layer calls it when its
    forward executes ``yield pop(name)``, at most once per name and forward. It returns
    the tensor (or ``None``) and raises :exc:`KeyError` when the tracker has no such skip;
    the layer turns that into ``RuntimeError("'name' has not been stashed")``.

    This class keeps skips in ``self.tensors``, keyed by (namespace, name): a pop takes
    what the latest stash of that key left. That is all a plain ``nn.Sequential`` needs:
    stash and pop happen on the same thread in the same call. A later stash of a key that
    was not popped replaces the earlier one, so the tracker holds at most one tensor per
    key.

    A pipe runtime installs its own tracker (``with use_skip_tracker(t): cell(x)``) for
    each (cell, micro-batch) it runs, on the thread that runs it. It overrides ``save`` to
    hold back the skips whose pop lies in a later cell and send them there with the
    micro-batch, and ``load`` to answer pops of skips stashed in an earlier cell with what
    it received; :class:`CellSkipTracker` does exactly that given a :class:`SkipLayout`.
    """

    def __init__(self) -> None:
        self.tensors: dict[SkipKey, Tensor | None] = {}

    def save(self, ns: Namespace | None, name: str, tensor: Tensor | None) -> None:
        """Hook (a): a layer stashed ``tensor`` as (ns, name)."""
        self.tensors[(ns, name)] = tensor

    def load(self, ns: Namespace | None, name: str) -> Tensor | None:
        """Hook (b): a layer pops (ns, name); :exc:`KeyError` when it was not stashed."""
        return self.tensors.pop((ns, name))


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


class _ThreadTracker(threading.local):
    def __init__(self) -> None:
        self.tracker: SkipTracker | None = None


_local = _ThreadTracker()


@contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Iterator[SkipTracker]:
    """Makes ``tracker`` the current thread's skip tracker inside the ``with`` block
    (yielding it), then restores the one before; other threads are not affected."""
    previous = _local.tracker
    _local.tracker = tracker
    try:
        yield tracker
    finally:
        _local.tracker = previous


def current_skip_tracker() -> SkipTracker:
    """The current thread's skip tracker: the innermost :func:`use_skip_tracker`'s, else
    the thread's default one (a :class:`SkipTracker`, made at first use)."""
    tracker = _local.tracker
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker

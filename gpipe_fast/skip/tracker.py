"""The skip tracker: where a stashed skip waits for its pop, one per thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor

from gpipe_fast.skip.namespace import Namespace

__all__ = ["SkipKey", "SkipTracker", "current_skip_tracker", "use_skip_tracker"]

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
    it received; ``CellSkipTracker`` (skip/cell_tracker.py) does exactly that given a
    ``SkipLayout``.
    """

    def __init__(self) -> None:
        self.tensors: dict[SkipKey, Tensor | None] = {}

    def save(self, ns: Namespace | None, name: str, tensor: Tensor | None) -> None:
        """Hook (a): a layer stashed ``tensor`` as (ns, name)."""
        self.tensors[(ns, name)] = tensor

    def load(self, ns: Namespace | None, name: str) -> Tensor | None:
        """Hook (b): a layer pops (ns, name); :exc:`KeyError` when it was not stashed."""
        return self.tensors.pop((ns, name))


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

"""Which pass a layer runs in: the checkpointed forward, the recompute, or neither."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Cells run on worker threads, so the pass is per thread.
_state = threading.local()


def is_checkpointing() -> bool:
    """True inside the forward of a micro-batch whose activations will be recomputed."""
    return getattr(_state, "checkpointing", False)


def is_recomputing() -> bool:
    """True inside the forward that rebuilds activations during backward."""
    return getattr(_state, "recomputing", False)


@contextmanager
def pass_flags(*, checkpointing: bool, recomputing: bool) -> Iterator[None]:
    """Sets the two flags for the duration of one task on the current thread."""
    saved = (is_checkpointing(), is_recomputing())
    _state.checkpointing, _state.recomputing = checkpointing, recomputing
    try:
        yield
    finally:
        _state.checkpointing, _state.recomputing = saved

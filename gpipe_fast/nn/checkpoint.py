"""Which pass a layer runs in: the checkpointed forward, the recompute, or neither."""

from __future__ import annotations

import threading

# Cells run on worker threads, so the pass is per thread.
_state = threading.local()


def recomputed_microbatches(checkpoint: str, count: int) -> list[bool]:
    """Which of `count` micro-batches a training step recomputes in checkpoint mode
    `checkpoint`: all ("always"), all but the last ("except_last"; the last one's backward
    comes first, so its activations are needed at once) or none ("never")."""
    return [
        checkpoint == "always" or (checkpoint == "except_last" and m < count - 1)
        for m in range(count)
    ]


def is_checkpointing() -> bool:
    """True inside the forward of a micro-batch whose activations will be recomputed."""
    return getattr(_state, "checkpointing", False)


def is_recomputing() -> bool:
    """True inside the forward that rebuilds activations during backward."""
    return getattr(_state, "recomputing", False)


class pass_flags:
    """Sets the two flags for the duration of one task on the current thread (a class, not a
    generator: it runs on every task, where a generator's overhead shows)."""

    __slots__ = ("_checkpointing", "_recomputing", "_saved")

    def __init__(self, *, checkpointing: bool, recomputing: bool) -> None:
        self._checkpointing, self._recomputing = checkpointing, recomputing
        self._saved = (False, False)

    def __enter__(self) -> None:
        self._saved = (is_checkpointing(), is_recomputing())
        _state.checkpointing, _state.recomputing = self._checkpointing, self._recomputing

    def __exit__(self, *_: object) -> None:
        _state.checkpointing, _state.recomputing = self._saved

"""Pipes still holding workers, closed before the interpreter starts tearing down."""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol


class Closable(Protocol):
    def close(self) -> None: ...


_live: weakref.WeakSet[Closable] = weakref.WeakSet()


def add(pipe: Closable) -> None:
    _live.add(pipe)


def discard(pipe: Closable) -> None:
    _live.discard(pipe)


@atexit.register
def _close_live_pipes() -> None:
    for pipe in list(_live):
        pipe.close()

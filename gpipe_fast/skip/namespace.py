"""Namespaces that keep skips of the same name apart: ``Layer().isolate(Namespace())``."""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["Namespace"]


class Namespace:
    """A namespace for skip names, given to :meth:`Skippable.isolate`.

    Every ``Namespace()`` is distinct from every other; a copy (``copy.copy``,
    ``copy.deepcopy``, pickling, as when a model is copied or sent to another process)
    equals its original, so a copied model keeps its skips paired. The default namespace,
    that of a layer never isolated, is ``None``.

    Namespaces compare with each other and with ``None`` without error (``None`` sorts
    first), so ``(namespace, name)`` keys mixing both can be sorted.
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        # Random, not a counter: namespaces made in different processes must differ too.
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Namespace):
            return self.id == other.id
        return NotImplemented

    def __lt__(self, other: Any) -> bool:
        if isinstance(other, Namespace):
            return self.id < other.id
        if other is None:
            return False
        return NotImplemented

    def __gt__(self, other: Any) -> bool:
        if isinstance(other, Namespace):
            return self.id > other.id
        if other is None:
            return True
        return NotImplemented

    def __le__(self, other: Any) -> bool:
        if isinstance(other, Namespace):
            return self.id <= other.id
        if other is None:
            return False
        return NotImplemented

    def __ge__(self, other: Any) -> bool:
        if isinstance(other, Namespace):
            return self.id >= other.id
        if other is None:
            return True
        return NotImplemented

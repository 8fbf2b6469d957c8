"""An atom's forward: its own outside a pipe's stage, the running stage's view of it inside one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torch import nn

_local = threading.local()


class View(Protocol):
    """What a thread running a stage (or the planner) makes of an atom's call."""

    def __call__(
        self, module: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any: ...


class AtomForward:
    """Replaces an atom's `forward` (an instance attribute, so that `module(...)` with all its
    hooks still runs it): the module's own forward unless this thread views a stage. Several
    threads may run different stages of one model at once: each has its own view."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self.module = module
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        view: View | None = getattr(_local, "view", None)
        if view is None:
            return self.forward(*args, **kwargs)
        return view(self.module, self.forward, args, kwargs)


def install(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Gives each module (once) the dispatching forward; returns those it was given now."""
    added = []
    for module in modules:
        if not isinstance(module.__dict__.get("forward"), AtomForward):
            module.forward = AtomForward(module, module.forward)
            added.append(module)
    return added


def uninstall(modules: Iterable[nn.Module]) -> None:
    for module in modules:
        found = module.__dict__.get("forward")
        if isinstance(found, AtomForward):
            del module.forward


@contextmanager
def installed(modules: Iterable[nn.Module]) -> Iterator[None]:
    added = install(modules)
    try:
        yield
    finally:
        uninstall(added)


@contextmanager
def viewing(view: View) -> Iterator[None]:
    """Atoms called on this thread go through `view` meanwhile."""
    previous = getattr(_local, "view", None)
    _local.view = view
    try:
        yield
    finally:
        _local.view = previous

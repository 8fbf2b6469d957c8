"""An atom's call: the module's own outside a pipe's run, the running stage's (or planner's)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torch import nn

_local = threading.local()


class Run(Protocol):
    """What a thread running a stage (or the planner) makes of an atom's call: `call` is the
    module's own (its hooks, then its forward)."""

    def atom(self, module: nn.Module, args: Any, kwargs: Any, call: Callable[..., Any]) -> Any: ...


class AtomCall:
    """Set as an atom's `_compiled_call_impl`, which `module(...)` calls instead of its usual
    call: that call itself unless this thread runs a stage, whose run then decides. A stage
    runs its own atoms so, hooks and all; another stage's atom is a placeholder, and no hook
    of the module fires for it. Several threads may run different stages of one model at
    once: each has its own run. A `module.compile()` before the pipe was built is kept (its
    compiled call runs the module's own calls)."""

    def __init__(self, module: nn.Module, previous: Callable[..., Any] | None) -> None:
        self.module = module
        self.previous = previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.previous if self.previous is not None else self.module._call_impl
        run: Run | None = getattr(_local, "run", None)
        if run is None:
            return call(*args, **kwargs)
        return run.atom(self.module, args, kwargs, call)


def install(modules: Iterable[nn.Module]) -> None:
    """Gives each module (once) the dispatching call."""
    for module in modules:
        found = module.__dict__.get("_compiled_call_impl")
        if not isinstance(found, AtomCall):
            module._compiled_call_impl = AtomCall(module, found)


def current() -> Run | None:
    """The run this thread is in (None outside any)."""
    return getattr(_local, "run", None)


@contextmanager
def running(run: Run) -> Iterator[None]:
    """Atoms called on this thread go through `run` meanwhile."""
    previous = getattr(_local, "run", None)
    _local.run = run
    try:
        yield
    finally:
        _local.run = previous

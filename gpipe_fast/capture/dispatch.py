"""An atom's call: the module's own outside a pipe's run, the running stage's (or planner's)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torch import nn

from gpipe_fast.nn.compiled import is_compiled, original, warn_eager

_local = threading.local()


class Run(Protocol):
    """What a thread running a stage (or the planner) makes of an atom's call: `call` is the
    module's own (its hooks, then its forward)."""

    def dispatches(self, module: nn.Module) -> bool:
        """Whether `module` is one of this run's atoms (a module another pipe of the model
        cut elsewhere made an atom is called as it is)."""
        ...

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
        if run is None or not run.dispatches(self.module):
            return call(*args, **kwargs)
        return run.atom(self.module, args, kwargs, call)


def install(modules: Iterable[nn.Module]) -> None:
    """Gives each module (once) the dispatching call."""
    for module in modules:
        found = module.__dict__.get("_compiled_call_impl")
        if not isinstance(found, AtomCall):
            module._compiled_call_impl = AtomCall(module, found)


class EagerInRun:
    """Replaces the compiled call of a compiled module that holds atoms (the model, or a part
    of it cut by split points): inside a run it runs uncompiled, since torch.compile cannot
    trace a stage's dispatch, and warns once naming it; outside, compiled as ever."""

    def __init__(self, module: nn.Module, compiled: Callable[..., Any], name: str) -> None:
        self.module = module
        self.compiled = compiled
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "run", None) is None:
            return self.compiled(*args, **kwargs)
        warn_eager(self.module, self.name, "it holds stage boundaries or other stages' modules, "
                   "so its compiled graph would span stages; compile the blocks inside it "
                   "instead (each decoder layer, for example)")  # fmt: skip
        inner = original(self.module)  # torch.compile(module): the module it wraps, uncompiled
        if inner is not self.module:
            return inner(*args, **kwargs)
        return self.module._call_impl(*args, **kwargs)


def run_eagerly_in_runs(model: nn.Module, atoms: Iterable[nn.Module]) -> None:
    """Makes each compiled module of `model` that holds one of `atoms` (once) run uncompiled
    inside a stage's run (EagerInRun)."""
    inside = {id(m) for atom in atoms for m in atom.modules()}
    for name, module in model.named_modules():
        if id(module) in inside or not is_compiled(module):
            continue
        if not any(id(m) in inside for m in module.modules()):
            continue
        attribute = "forward" if module.__dict__.get("_compiled_call_impl") is None else (
            "_compiled_call_impl")  # fmt: skip
        compiled = module.__dict__.get(attribute)
        if compiled is not None and not isinstance(compiled, EagerInRun):
            setattr(module, attribute, EagerInRun(module, compiled, name or "the model"))


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

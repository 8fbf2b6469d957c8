"""An atom's forward: its own outside a pipe's stage, the running stage's view of it inside one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torch import nn

from gpipe_fast.nn.compiled import is_compiled, original, warn_eager

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


class CompiledForward:
    """A compiled atom's call, as a view gets it for `forward`: calling it runs the compiled
    code; `__func__` bound to a copy of the module (`__self__`) runs that copy's own forward
    uncompiled, which is what a placeholder computes shapes with."""

    def __init__(self, module: nn.Module, compiled: Callable[..., Any]) -> None:
        self.__self__ = module
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    @staticmethod
    def __func__(copy: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return original(copy).forward(*args, **kwargs)


class AtomCall:
    """Replaces a `.compile()`d atom's compiled call: outside a view, the compiled call;
    inside one, the view gets the call with the compiled code as its forward. The view sits
    outside the compiled region, which torch.compile could not trace through (it would run
    the module eagerly, and every module compiled so ever after)."""

    def __init__(self, module: nn.Module, compiled: Callable[..., Any]) -> None:
        self.module = module
        self.compiled = compiled
        self.forward = CompiledForward(module, compiled)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        view: View | None = getattr(_local, "view", None)
        if view is None:
            return self.compiled(*args, **kwargs)
        return view(self.module, self.forward, args, kwargs)


def install(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Gives each module (once) the dispatching forward (a `.compile()`d one: the
    dispatching compiled call); returns those it was given now."""
    added = []
    for module in modules:
        compiled = module.__dict__.get("_compiled_call_impl")
        if isinstance(compiled, AtomCall) or isinstance(
            module.__dict__.get("forward"), AtomForward
        ):
            continue
        if compiled is not None:
            module._compiled_call_impl = AtomCall(module, compiled)
        else:
            forward = module.forward
            if is_compiled(module):  # torch.compile(module): its forward is the compiled code
                forward = CompiledForward(module, forward)
            module.forward = AtomForward(module, forward)
        added.append(module)
    return added


def uninstall(modules: Iterable[nn.Module]) -> None:
    for module in modules:
        found = module.__dict__.get("forward")
        if isinstance(found, AtomForward):
            del module.forward
            if isinstance(found.forward, CompiledForward):  # an OptimizedModule's own
                module.forward = found.forward.compiled
        compiled = module.__dict__.get("_compiled_call_impl")
        if isinstance(compiled, AtomCall):
            module._compiled_call_impl = compiled.compiled


class EagerInView:
    """Replaces the compiled call of a compiled module that holds atoms (the model, or a
    part of it cut by split points): inside a view it runs uncompiled, since torch.compile
    cannot trace the view, and warns once naming it; outside, compiled as ever."""

    def __init__(self, module: nn.Module, compiled: Callable[..., Any], name: str) -> None:
        self.module = module
        self.compiled = compiled
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "view", None) is None:
            return self.compiled(*args, **kwargs)
        warn_eager(self.module, self.name, "it holds stage boundaries or other stages' modules, "
                   "so its compiled graph would span stages; compile the blocks inside it "
                   "instead (each decoder layer, for example)")  # fmt: skip
        module = self.module
        inner = original(module)  # torch.compile(module): the module it wraps, uncompiled
        if inner is not module:
            return inner(*args, **kwargs)
        return module._call_impl(*args, **kwargs)


def run_eagerly_in_views(model: nn.Module, atoms: Iterable[nn.Module]) -> None:
    """Makes each compiled module of `model` that holds one of `atoms` (once) run
    uncompiled inside a view (EagerInView)."""
    inside = {id(m) for atom in atoms for m in atom.modules()}
    for name, module in model.named_modules():
        if id(module) in inside or not is_compiled(module):
            continue
        if not any(id(m) in inside for m in module.modules()):
            continue
        compiled_call = module.__dict__.get("_compiled_call_impl")
        attribute = "forward" if compiled_call is None else "_compiled_call_impl"
        compiled = module.__dict__.get(attribute)
        if compiled is not None and not isinstance(compiled, EagerInView):
            setattr(module, attribute, EagerInView(module, compiled, name or "the model"))


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

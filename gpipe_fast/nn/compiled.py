"""Layers compiled with torch.compile: found, copied uncompiled, and warned about when eager."""

from __future__ import annotations

import sys
import threading
import types
import warnings
import weakref

from torch import nn

# Per module, the reasons it was already warned about.
_warned: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
_warned_lock = threading.Lock()


def _optimized_module() -> type[nn.Module] | None:
    """torch.compile's module class, where dynamo is loaded. A module can only be one once
    torch.compile has imported dynamo, and importing it only to ask took 0.9 s of every
    process that builds a pipe of modules none of which is compiled."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_compiled(module: nn.Module) -> bool:
    """Whether calling `module` runs compiled code: `torch.compile(module)` (an
    OptimizedModule) or `module.compile()`."""
    if module.__dict__.get("_compiled_call_impl") is not None:
        return True
    optimized = _optimized_module()
    if optimized is None or not isinstance(module, optimized):
        return False
    forward = module.__dict__.get("forward")  # uncompile() makes it the wrapped module's call
    return not (isinstance(forward, types.MethodType) and forward.__self__ is _wrapped(module))


def _wrapped(module: nn.Module) -> nn.Module | None:
    return module._modules.get("_orig_mod")


def holds_compiled(module: nn.Module) -> bool:
    """Whether `module` or a module inside it is compiled."""
    return any(is_compiled(m) for m in module.modules())


def original(module: nn.Module) -> nn.Module:
    """The module a `torch.compile(module)` wraps; any other module itself."""
    optimized = _optimized_module()
    inner = _wrapped(module)
    return inner if inner is not None and optimized and isinstance(module, optimized) else module


def uncompile(module: nn.Module) -> None:
    """Makes every module of `module` (a private copy) run its own forward uncompiled.

    A copy of a `.compile()`d module keeps the original's compiled call, which runs the
    original module (torch.compile wrapped its bound `_call_impl`); a copied OptimizedModule
    compiles again for what it is given. A copy made to compute shapes on fake tensors must do
    neither."""
    optimized = _optimized_module()
    for owner in module.modules():
        if owner.__dict__.get("_compiled_call_impl") is not None:
            owner._compiled_call_impl = None
        if optimized is not None and isinstance(owner, optimized):
            owner.forward = original(owner).__call__


def warn_eager(module: nn.Module, name: str, why: str) -> None:
    """Warns once per module and reason that the pipe runs the compiled `module` (called
    `name`) eagerly, and why."""
    with _warned_lock:
        reasons = _warned.setdefault(module, set())
        if why in reasons:
            return
        reasons.add(why)
    warnings.warn(
        f"gpipe_fast: the compiled module {name!r} runs eagerly inside the pipe: {why}",
        RuntimeWarning,
        stacklevel=3,
    )

"""Per-task random generators, so dropout masks replay exactly and never race between cells."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# PyTorch's default generators are global: cells running at once on worker threads would
# interleave their draws, and a recompute could not replay them. Instead every random op of
# a task gets a generator seeded from (step seed, cell, micro-batch), through a dispatch
# mode, which is thread-local, so concurrent cells never share a stream of random numbers.


def may_draw_random(module: torch.nn.Module) -> bool:
    """Whether `module` might draw random numbers: it holds a random torch.nn layer (dropout,
    RReLU, attention with dropout) or any layer defined outside torch.nn, which could do
    anything. Cells made only of other torch.nn layers never need the dispatch mode, whose
    first use costs seconds (it imports torch._dynamo)."""
    for layer in module.modules():
        if not type(layer).__module__.startswith("torch.nn."):
            return True
        if isinstance(layer, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU)):
            return True
        if isinstance(layer, torch.nn.MultiheadAttention) and layer.dropout > 0:
            return True
    return False


def task_seed(step_seed: int, cell: int, microbatch: int) -> int:
    """A 63-bit seed for one (cell, micro-batch) of a step; deterministic across processes."""
    return hash((step_seed, cell, microbatch)) & ((1 << 63) - 1)


def draw_step_seed() -> int:
    """Draws a step's seed from the caller's default generator (so torch.manual_seed rules)."""
    return int(torch.randint(0, 1 << 62, (1,)).item())


@functools.cache
def _with_generator(op: Any) -> Any | None:
    """The overload of `op` that takes a generator: itself, its generator twin, or None."""
    if any(arg.name == "generator" for arg in op._schema.arguments):
        return op
    name = op._overloadname
    twin = "generator" if name == "default" else f"{name}_generator"
    overload = getattr(op.overloadpacket, twin, None)
    if overload is not None and any(a.name == "generator" for a in overload._schema.arguments):
        return overload
    return None


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.device("cpu")


class TaskRandomness(TorchDispatchMode):
    """Routes every random op in its scope through generators seeded with `seed`.

    `used` tells afterwards whether anything random ran, so that cells which draw nothing
    can skip the mode (and its per-op cost) from then on.
    """

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.used = False
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        target = _with_generator(func)
        if target is None or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        self.used = True
        kwargs["generator"] = self._generator(_device_of(args, kwargs))
        return target(*args, **kwargs)

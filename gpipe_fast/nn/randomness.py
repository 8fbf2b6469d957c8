"""Per-task random streams, so dropout masks replay exactly and never race between cells."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Each task (cell, micro-batch) of a step draws its random numbers from a stream of its own,
# seeded from (step seed, cell, micro-batch), so that a recompute replays the forward's
# draws whatever order the threads ran in. The stream is the process's own default
# generators (the CPU's and the cell's GPU's), set to the task's seed for the task's duration
# and put back after it, as torch.utils.checkpoint does around a recompute. So everything that
# draws sees it: eager ops, fused GPU kernels that take no generator (dropout, attention with
# dropout), compiled code (inductor draws its seeds from these generators), and a model's own
# torch.utils.checkpoint, which saves and restores these generators' states around its
# recompute. The generators are the process's, so one task at a time holds them: the cells
# that draw random numbers take turns while they compute (`_HELD`); those that draw none run
# freely. No dispatch mode is involved, which would make torch.compile fall back to eager.

_HELD = threading.RLock()


def may_draw_random(module: torch.nn.Module) -> bool:
    """Whether `module` might draw random numbers: it holds a random torch.nn layer (dropout,
    RReLU, attention with dropout) or any layer defined outside torch.nn, which could do
    anything. Cells made only of other torch.nn layers never take the generators."""
    for layer in module.modules():
        if not type(layer).__module__.startswith("torch.nn."):
            return True
        if isinstance(layer, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU)):
            return True
        if isinstance(layer, torch.nn.MultiheadAttention) and layer.dropout > 0:
            return True
    return False


# The parts of a step that draw from a stream of their own (besides each cell's forward,
# whose recompute draws the same): a cell's backward, a micro-batch's loss.
BACKWARD, LOSS = 1, 2


def task_seed(step_seed: int, cell: int, microbatch: int, part: int = 0) -> int:
    """A 63-bit seed for one task of a step: a cell's forward (and its recompute, which must
    draw the same), or another `part` of it (BACKWARD, LOSS). Deterministic across processes
    and runs (a tuple of ints hashes the same everywhere, unlike a string)."""
    key = (step_seed, cell, microbatch) + ((part,) if part else ())
    return hash(key) & ((1 << 63) - 1)


def draw_step_seed() -> int:
    """Draws a step's seed from the caller's default generator (so torch.manual_seed rules)."""
    return int(torch.randint(0, 1 << 62, (1,)).item())


def default_generators(device: torch.device) -> list[torch.Generator]:
    """The process's default generators a task on `device` draws from: the CPU's, and the
    GPU's of a CUDA device."""
    generators = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generators.append(torch.cuda.default_generators[index])
    return generators


class TaskStream:
    """The default generators of `device` (and the CPU's) set to `seed` while it is entered,
    held by this thread alone, and put back afterwards. `drew` tells afterwards whether
    anything drew from them, watched as `watch` says: "states" compares their states before
    and after (free, but blind to a draw made from a state that was restored after it, as a
    model's own checkpoint does in its recompute); "ops" watches every op for random ones
    (a dispatch mode, which leaves compiled code compiled); None does not watch."""

    __slots__ = ("_generators", "_mode", "_saved", "_seeded", "drew", "seed", "watch")

    def __init__(self, seed: int, device: torch.device, *, watch: str | None = None) -> None:
        self.seed = seed
        self.watch = watch
        self.drew = False
        self._generators = default_generators(device)
        self._saved: list[torch.Tensor] = []
        self._seeded: list[torch.Tensor] = []
        self._mode: DrawWatch | None = None

    def __enter__(self) -> TaskStream:
        _HELD.acquire()
        try:
            self._saved = [g.get_state() for g in self._generators]
            for generator in self._generators:
                generator.manual_seed(self.seed)
            if self.watch == "states":
                self._seeded = [g.get_state() for g in self._generators]
            elif self.watch == "ops":
                self._mode = DrawWatch()
                self._mode.__enter__()
        except BaseException:
            _HELD.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
                self.drew = self._mode.drew
                self._mode = None
            elif self.watch == "states":
                self.drew = any(
                    not torch.equal(g.get_state(), seeded)
                    for g, seeded in zip(self._generators, self._seeded, strict=True)
                )
            for generator, state in zip(self._generators, self._saved, strict=True):
                generator.set_state(state)
        finally:
            _HELD.release()


class DrawWatch(TorchDispatchMode):
    """Notes whether any random op ran in its scope (on this thread, and on autograd's device
    threads working for it). It leaves compiled code compiled (ignore_compile_internals)."""

    def __init__(self) -> None:
        super().__init__()
        self.drew = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # A backward op replays the seed its forward saved (attention's, on a GPU): no draw.
        if torch.Tag.nondeterministic_seeded in func.tags and not _is_backward(func):
            self.drew = True
        return func(*args, **(kwargs or {}))


def _is_backward(func: Any) -> bool:
    return str(func._opname).endswith("_backward")

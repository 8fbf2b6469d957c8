"""One stage's lasting runtime: its layers, device and stream, and how it runs a micro-batch."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gpipe_fast.device.streams import CellStreams
from gpipe_fast.nn.batchnorm import frozen_running_stats, plain_batch_norms
from gpipe_fast.nn.buffer_writes import BufferWrites, Snapshot
from gpipe_fast.nn.checkpoint import pass_flags
from gpipe_fast.nn.compiled import holds_compiled
from gpipe_fast.nn.pytree import Tree, tensors_of, with_tensors
from gpipe_fast.nn.randomness import BACKWARD, TaskStream, may_draw_random, task_seed
from gpipe_fast.skip.cell_tracker import CellSkipTracker
from gpipe_fast.skip.tracker import SkipKey, use_skip_tracker


@dataclass(frozen=True)
class AutocastState:
    """The caller's autocast settings, replayed on the worker threads."""

    settings: tuple[tuple[str, bool, torch.dtype], ...]

    @property
    def enabled(self) -> bool:
        return any(on for _, on, _ in self.settings)

    @classmethod
    def capture(cls) -> AutocastState:
        return cls(
            tuple(
                (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                for kind in ("cpu", "cuda")
            )
        )

    def enter(self, stack: ExitStack) -> None:
        for kind, enabled, dtype in self.settings:
            if enabled:
                stack.enter_context(torch.autocast(kind, dtype=dtype))


def _global_hooks() -> bool:
    """Whether any module hook was registered for every module (nn.modules.module's
    register_module_forward_hook and the like)."""
    from torch.nn.modules import module as torch_module

    return bool(
        torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
    )


# A layer's boundary in a split (per-layer) forward: its detached input leaves and outputs
# (the tensor leaves of what it took and returned, in order; other leaves need no gradient),
# then the keys of the skips it popped and stashed. The popped skips' leaves end `inputs`
# and the stashed skips' tensors end `outputs`, in the order of their keys.
Boundary = tuple[tuple[Tensor, ...], tuple[Tensor, ...], tuple[SkipKey, ...], tuple[SkipKey, ...]]


class Cell:
    """What lasts of stage `index` between steps: the module, its device and stream, the
    worker settings, and which passes draw random numbers."""

    def __init__(
        self,
        index: int,
        module: nn.Sequential,
        device: torch.device,
        streams: CellStreams,
        threads: int | None,
    ) -> None:
        self.index = index
        self.module = module
        self.device = device
        self.streams = streams
        self.threads = threads
        self.batch_norms = plain_batch_norms(module)
        self.buffer_writes = BufferWrites(module, list(self.batch_norms))
        self.stream = streams.streams[index]  # None on a CPU cell
        self.prepared = False
        # The cell's modules, whose training flags make its mode: what a forward draws and
        # writes depends on it, and the user may set it on the modules themselves
        # (model.eval() reaches the layers, not the cell's own container).
        self.modules = list(module.modules())
        self.draws_nothing = not may_draw_random(module)
        # mode -> whether the cell's forward drew random numbers; absent: unknown.
        self.random: dict[tuple[bool, ...], bool] = {}
        # Per backward action (backward, backward_input, backward_weight) and mode, whether
        # it draws random numbers (a model's own checkpoint recomputing a forward that drew);
        # absent: not seen yet. Each action apart: backward_input may have nothing to do on a
        # stage whose input needs no gradient, where backward_weight recomputes.
        self.backward_draws: dict[tuple[str, tuple[bool, ...]], bool] = {}
        # Per layer, whether it holds compiled code, whose backward is one compiled function:
        # a split backward runs it whole in backward_input.
        self.whole_backward = [holds_compiled(layer) for layer in module]

    @property
    def learns(self) -> bool:
        return any(p.requires_grad for p in self.module.parameters())

    def mode(self) -> tuple[bool, ...]:
        """The training flag of each of the cell's modules."""
        return tuple([m.training for m in self.modules])

    def may_draw_random(self) -> bool:
        return not self.draws_nothing and self.random.get(self.mode(), True)

    def prepare_worker(self) -> None:
        """Per-worker settings, made once on the worker's own thread."""
        if self.prepared:
            return
        self.prepared = True
        if self.device.type == "cpu" and self.threads is not None:
            torch.set_num_threads(self.threads)

    def run(
        self,
        value: Tree,
        *,
        seed: int,
        microbatch: int,
        autocast: AutocastState,
        grad: bool,
        checkpointing: bool = False,
        recomputing: bool = False,
        boundaries: list[Boundary] | None = None,
        skips: CellSkipTracker | None = None,
        snapshots: list[Snapshot | None] | None = None,
    ) -> Tree:
        """The cell on one micro-batch under what its forward needs: its worker's settings,
        its stream, the caller's autocast, the pass flags, the task's own random stream
        and (recomputing) frozen BatchNorm statistics. With `boundaries`, the layers run one
        by one with the graph cut between them, each layer's (input leaves, outputs) appended
        there, so that input and weight gradients can be computed apart (zero bubble). With
        `skips`, the cell's skippable layers stash and pop through that tracker. With
        `snapshots`, a checkpointed forward saves the buffers it writes in
        `snapshots[microbatch]`, and its recompute runs from them. The common CPU case skips
        every part it does not need: this runs on every task."""
        if not self.prepared:
            self.prepare_worker()
        # The mode matters only to a cell that may draw or write: () stands for it elsewhere.
        mode = () if self.draws_nothing and not self.buffer_writes.holds else self.mode()
        random = not self.draws_nothing and self.random.get(mode, True)
        batch_norms = self.batch_norms if recomputing else []
        flags = pass_flags(checkpointing=checkpointing, recomputing=recomputing)
        writes = (
            snapshots is not None
            and (checkpointing or recomputing)
            and self.buffer_writes.may_write(mode)
        )
        if not (random or batch_norms or writes or autocast.enabled or self.stream is not None):
            # The common CPU case, on every task: the flags and grad mode without contexts.
            previous = torch.is_grad_enabled()
            if previous != grad:
                torch._C._set_grad_enabled(grad)
            try:
                with flags:
                    return self._forward(value, boundaries, skips)
            finally:
                if previous != grad:
                    torch._C._set_grad_enabled(previous)
        with ExitStack() as stack:
            stack.enter_context(self.streams.on(self.index))
            autocast.enter(stack)
            stack.enter_context(flags)
            stack.enter_context(frozen_running_stats(batch_norms))
            stack.enter_context(torch.set_grad_enabled(grad))
            if writes and snapshots is not None:
                if checkpointing:
                    snapshots[microbatch] = self.buffer_writes.save(mode)
                else:  # recomputing: from the buffers as its forward found them
                    stack.enter_context(self.buffer_writes.replaying(snapshots[microbatch]))
                    snapshots[microbatch] = None
            stream = None
            if random:  # last: the generators are held for the forward alone
                watch = None if mode in self.random else "states"
                stream = TaskStream(task_seed(seed, self.index, microbatch), self.device,
                                    watch=watch)  # fmt: skip
                stack.enter_context(stream)
            output = self._forward(value, boundaries, skips)
            if writes and checkpointing and snapshots is not None:
                snapshots[microbatch] = self.buffer_writes.learn(snapshots[microbatch])
        if stream is not None and stream.watch is not None:
            self.random[mode] = stream.drew
        return output

    def backward_stream(self, seed: int, microbatch: int, action: str) -> TaskStream | None:
        """The random stream a backward task (of `action`) of the cell runs in (None: none
        needed): a backward that recomputes a forward that drew (a model's own checkpoint
        inside the cell) must hold the generators, whose states that checkpoint restores to
        replay its forward's draws. Whether it does is watched on the action's first task,
        until one draws or does the work."""
        if self.draws_nothing:
            return None
        mode = self.mode()
        drew = self.backward_draws.get((action, mode))
        if drew is False or not self.random.get(mode, True):
            return None
        watch = "ops" if drew is None else None
        return TaskStream(task_seed(seed, self.index, microbatch, BACKWARD), self.device,
                          watch=watch)  # fmt: skip

    def backward_seen(self, stream: TaskStream | None, action: str, *, ran: bool) -> None:
        """Records what a watched backward task found; one that `ran` no backward (nothing
        to do) tells nothing, and the next is watched."""
        if stream is not None and stream.watch is not None and (ran or stream.drew):
            self.backward_draws[(action, self.mode())] = stream.drew

    def _forward(
        self, value: Tree, boundaries: list[Boundary] | None, skips: CellSkipTracker | None
    ) -> Tree:
        if skips is None:
            return self._layers(value, boundaries, None)
        with use_skip_tracker(skips):
            return self._layers(value, boundaries, skips)

    def _layers(
        self, value: Tree, boundaries: list[Boundary] | None, skips: CellSkipTracker | None
    ) -> Tree:
        module = self.module
        if boundaries is None:
            if module._forward_hooks or module._forward_pre_hooks or _global_hooks():
                return module(value)
            # No hook on the cell itself (its layers' hooks run as ever): skip __call__'s
            # frames, a few microseconds on every task.
            return module.forward(value)
        for layer in self.module:
            # A layer gets what the one before returned as one argument, as nn.Sequential
            # passes it (a tuple or a dict is not unpacked).
            inputs = tensors_of(value)
            output = layer(value)
            outputs = tensors_of(output)
            if skips is not None and skips.cut:
                popped, stashed = skips.take_layer()
                boundaries.append((
                    inputs + tuple(t for _, t in popped),
                    outputs + tuple(t for _, t in stashed),
                    tuple(key for key, _ in popped),
                    tuple(key for key, _ in stashed),
                ))  # fmt: skip
            else:
                boundaries.append((inputs, outputs, (), ()))
            # The next layer starts a graph of its own: a fresh leaf per output tensor.
            value = with_tensors(
                output, [t.detach().requires_grad_(t.requires_grad) for t in outputs]
            )
        return value

    def layer_parameters(self) -> list[list[Tensor]]:
        """Per layer, its parameters that learn (in module order)."""
        return [[p for p in layer.parameters() if p.requires_grad] for layer in self.module]

"""schedule, chunks and checkpoint "auto": what a pipe tunes, when, and the hook that tunes it.

The tuning itself (ranking the candidates with gf.plan, measuring the best, agreeing across
ranks) lives in planning/tune.py, a layer above this one: it installs itself here when
gpipe_fast is imported (`install_tuner`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn

from gpipe_fast.errors import SignatureChanged
from gpipe_fast.nn.microbatch import Value, as_tensors
from gpipe_fast.nn.signature import input_signature

# A GPipe (api/gpipe.py imports this module, so it is not named here).
GPipe = Any

AUTO = "auto"
# What an "auto" setting starts as, until the first tuning: GPipe's own defaults but the
# micro-batches, one per cell (chunks=1 would pipeline nothing).
INITIAL = {"schedule": "gpipe", "checkpoint": "except_last"}


@dataclass(frozen=True)
class Cut:
    """How a pipe's cells are cut and run: its schedule kind and its balance (with
    gf.pipeline, its split points, one layer per cell)."""

    schedule: str
    balance: tuple[int, ...]
    split_points: tuple[str, ...] | None = None

    def __str__(self) -> str:
        cut = (
            f"split points {list(self.split_points)}"
            if self.split_points is not None
            else f"balance {list(self.balance)}"
        )
        return f"{self.schedule}, {cut}"


@dataclass(frozen=True)
class Config:
    """One way to run a pipe's training steps: its cut, micro-batches and checkpointing."""

    cut: Cut
    chunks: int
    checkpoint: str

    def __str__(self) -> str:
        return f"{self.cut}, chunks {self.chunks}, checkpoint {self.checkpoint!r}"


@dataclass(frozen=True)
class Tuned:
    """Which of a pipe's settings are tuned: the schedule (with it the cells, unless the
    balance or split points were given), the micro-batches, the checkpointing."""

    schedule: bool
    chunks: bool
    checkpoint: bool
    cut: bool

    @classmethod
    def of(
        cls, schedule: object, chunks: object, checkpoint: object, *, cut_given: bool
    ) -> Tuned | None:
        """What "auto" asks for among the arguments (None: nothing)."""
        flags = [_is_auto(value) for value in (schedule, chunks, checkpoint)]
        if not any(flags):
            return None
        return cls(flags[0], flags[1], flags[2], cut=flags[0] and not cut_given)

    def initial(self, schedule: Any, chunks: Any, checkpoint: Any) -> tuple[Any, Any, Any]:
        """The values a pipe is built with until its first tuning (chunks: 1 here, one per
        cell once the cells are known; see AutoPipe.attach)."""
        return (
            INITIAL["schedule"] if self.schedule else schedule,
            1 if self.chunks else chunks,
            INITIAL["checkpoint"] if self.checkpoint else checkpoint,
        )

    def resolve(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """`arguments` (keywords of GPipe) with the initial values where "auto" was given."""
        resolved = dict(arguments)
        values = self.initial(arguments.get("schedule"), arguments.get("chunks"),
                              arguments.get("checkpoint"))  # fmt: skip
        for name, tuned, value in zip(("schedule", "chunks", "checkpoint"),
                                      (self.schedule, self.chunks, self.checkpoint), values,
                                      strict=True):  # fmt: skip
            if tuned:
                resolved[name] = value
        return resolved


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value == AUTO


class Builder(Protocol):
    """Makes pipes like the tuned one with another cut (GPipe: a balance; gf.pipeline:
    split points), sharing its model's layers."""

    # Whether the layers may move between processes (a whole model on every rank, which
    # the tuner checks): gf.pipeline's keep their split points across processes.
    moves_layers: bool
    model: nn.Module  # every layer, whichever cell or rank runs it
    # Whether gf.plan may profile deep copies of the layers (gf.pipeline's stages hold the
    # model's shape-only placeholders: they run where they are, the tuning restoring them).
    profiles_copies: bool

    def build(self, cut: Cut) -> GPipe:
        """A new pipe of `cut` over the same layers (closed by the caller)."""

    def rebuild(self, pipe: GPipe, cut: Cut) -> None:
        """`pipe` itself rebuilt with `cut` (its old runtime closed first)."""

    def cells_of(self, cut: Cut, pipe: GPipe) -> nn.Sequential:
        """The layers gf.plan prices for `cut`, one entry per layer of its balance."""

    def cuts(self, cells: int) -> list[tuple[str, ...]] | None:
        """gf.pipeline: the split points to try for `cells` cells (None: cut by a balance)."""

    def most_cells(self) -> int:
        """The most cells the model can be cut into (its layers; gf.pipeline's blocks)."""

    def step(self, pipe: GPipe, input: Value | None, target: Any, loss_fn: Any,
             reduction: str) -> Any:  # fmt: skip
        """One train_step of `pipe` (the tuned one or one it built) on the step's input as
        the tuned pipe's train_step received it."""


# The tuner, installed by planning/tune.py: tune(pipe, input, target, loss_fn, options)
# returns the pipe's Tuning (planning/tuning.py) for the step's signature.
Tuner = Callable[..., Any]
_TUNER: list[Tuner] = []


def install_tuner(tuner: Tuner) -> None:
    _TUNER[:] = [tuner]


@dataclass(frozen=True)
class TuneOptions:
    """How one tuning runs: `memory_per_device` (bytes; None: the device's memory on CUDA,
    no bound on CPU), `budget_s` (seconds of measuring; None: no bound but the count of
    candidates), `implicit` (at a train_step: across processes the cells then stay where they
    are, since the optimizer already holds this rank's parameters), `progress` (a bar on the
    first rank), `reduction` (the loss's, as train_step takes it)."""

    memory_per_device: int | None = None
    budget_s: float | None = None
    implicit: bool = False
    progress: bool = True
    reduction: str = "mean"


@dataclass
class AutoPipe:
    """A pipe's tuning state: what it tunes, how it rebuilds, and the choice per input
    signature (the shapes and dtypes of the step's input)."""

    tuned: Tuned
    builder: Builder
    tunings: dict[int, Any] = field(default_factory=dict)  # signature -> Tuning
    current: Any = None  # the Tuning in use
    busy: bool = False  # tuning now: its steps run as they are

    def attach(self, pipe: GPipe) -> None:
        pipe._auto = self
        if self.tuned.chunks:
            pipe.chunks = max(1, len(pipe.balance))

    def train_step(self, pipe: GPipe, run: Callable[[int | None], Any], input: Value | None,
                   target: Any, loss_fn: Any, reduction: str) -> Any:  # fmt: skip
        """`run(signature)`, one train_step of `pipe` on its cells as they are then: tunes
        at the first step (it may rebuild the cells); a later step checks its input's
        signature against the current choice's in the step's own agreement, and one of
        another stops before any task ran and runs again on that signature's choice."""
        expected = self.before_step(pipe, input, target, loss_fn, reduction)
        try:
            return run(expected)
        except SignatureChanged as changed:
            self.at_signature(pipe, changed.signature, input, target, loss_fn, reduction)
            return run(None)

    def before_step(self, pipe: GPipe, input: Value | None, target: Any, loss_fn: Any,
                    reduction: str) -> int | None:  # fmt: skip
        """Tunes at the first step (every rank at once). Returns the signature the step is
        to check its input against (the current choice's; None: no check): across processes
        cell 0's rank tells it with the batch size, so that a step of an unchanged signature
        sends no message of its own; an input of another raises SignatureChanged before any
        task, and the caller takes that signature's choice (at_signature) and runs the step
        again. Replicas (dp_group) agree on theirs here, at every step."""
        if self.busy:
            return None
        replicated = pipe.layout.dp_group is not None
        if self.current is not None and not replicated:
            return cast(int, self.current.signature)
        self.at_signature(pipe, signature(pipe, input), input, target, loss_fn, reduction)
        return None

    def at_signature(self, pipe: GPipe, key: int, input: Value | None, target: Any,
                     loss_fn: Any, reduction: str) -> None:  # fmt: skip
        """Takes the choice made for input signature `key` before, or tunes at it (every
        rank at once)."""
        tuning = self.tunings.get(key)
        if tuning is None:
            options = TuneOptions(implicit=True, reduction=reduction)
            self.tune(pipe, input, target, loss_fn, options, key)
        else:
            self.use(pipe, tuning)

    def tune(self, pipe: GPipe, input: Value | None, target: Any, loss_fn: Any,
             options: TuneOptions, key: int | None = None) -> Any:  # fmt: skip
        if not _TUNER:
            raise RuntimeError("gpipe_fast: no tuner installed (import gpipe_fast first)")
        if key is None:
            key = signature(pipe, input)
        tuning = _TUNER[0](pipe, input, target, loss_fn, options, key)
        self.tunings[key] = tuning
        self.use(pipe, tuning)
        return tuning

    def use(self, pipe: GPipe, tuning: Any) -> None:
        """Runs the next steps as `tuning` chose (its cut is the pipe's already)."""
        self.current = tuning
        pipe.chunks = tuning.choice.chunks
        pipe.checkpoint = tuning.choice.checkpoint

    @contextlib.contextmanager
    def tuning_now(self) -> Iterator[None]:
        self.busy = True
        try:
            yield
        finally:
            self.busy = False


def signature(pipe: GPipe, input: Value | None) -> int:
    """The step's input signature, the same on every rank: the shapes and dtypes of the
    input's tensors, hashed where cell 0 runs and told to the others."""
    local = 0
    pipeline = pipe._pipeline
    if input is not None and pipe.layout.is_local(0):
        local = input_signature(as_tensors(input, "input"))
    groups = pipeline.groups if pipeline is not None else None
    return local if groups is None else groups.signature(local)


def current_cut(pipe: GPipe) -> Cut:
    split = getattr(pipe, "split_points", None)
    return Cut(pipe.schedule, tuple(pipe.balance), None if split is None else tuple(split))


def rebuilt(pipe: GPipe, init: Callable[[], None]) -> None:
    """Runs `init` (the pipe's own __init__ with another cut) on `pipe`, keeping what
    the caller set on it: its tuning, its mode and step timeout."""
    auto, training, timeout = pipe._auto, pipe.training, pipe.step_timeout
    pipe.close()
    init()
    pipe._auto = auto
    pipe.train(training)
    if timeout is not None:
        pipe.step_timeout = timeout


class SequentialBuilder:
    """GPipe's builder: the same nn.Sequential with another balance and schedule, the other
    arguments as given (devices as the tuned pipe first placed its workers, when left to
    the default: the interleaved and zbv schedules then put two cells on each)."""

    moves_layers = True
    profiles_copies = True

    def __init__(self, module: nn.Sequential, arguments: dict[str, Any], pipe: GPipe) -> None:
        self.pipe_class = type(pipe)
        self.module = module
        self.model: nn.Module = module
        self.arguments = dict(arguments)
        for name in ("balance", "schedule", "chunks", "checkpoint"):
            self.arguments.pop(name, None)
        if self.arguments.get("devices") is None and not pipe.layout.multi_process:
            self.arguments["devices"] = worker_devices(pipe)

    def build(self, cut: Cut) -> GPipe:
        return self.pipe_class(self.module, list(cut.balance), schedule=cut.schedule,
                               **self.arguments)  # fmt: skip

    def rebuild(self, pipe: GPipe, cut: Cut) -> None:
        init = self.pipe_class.__init__
        rebuilt(pipe, lambda: init(pipe, self.module, list(cut.balance),
                                   schedule=cut.schedule, **self.arguments))  # fmt: skip

    def cells_of(self, cut: Cut, pipe: GPipe) -> nn.Sequential:
        return self.module

    def cuts(self, cells: int) -> list[tuple[str, ...]] | None:
        return None

    def most_cells(self) -> int:
        return len(self.module)

    def step(self, pipe: GPipe, input: Value | None, target: Any, loss_fn: Any,
             reduction: str) -> Any:  # fmt: skip
        return pipe.train_step(input, target, loss_fn, reduction=reduction)


def worker_devices(pipe: GPipe) -> list[torch.device]:
    """One device per worker of `pipe`, in the workers' order."""
    pipeline = pipe._pipeline
    if pipeline is None:
        return list(pipe.devices)
    found: dict[int, torch.device] = {}
    for device, worker in zip(pipe.devices, pipeline.stage_workers, strict=False):
        found.setdefault(worker, device)
    return [found[w] for w in sorted(found)]


def check_tunable(tuned: Tuned, dp_shard: bool) -> None:
    if dp_shard:
        raise ValueError(
            "dp_shard: a pipe of sharded stages cannot tune itself yet; give schedule, chunks "
            "and checkpoint (tune them on replicated stages)"
        )

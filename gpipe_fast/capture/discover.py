"""The plan of a model's pipe: its forward run twice on fake tensors, its module calls staged.

The first run records every module call (its name, where it starts and ends among the calls).
Split points cut the calls into stages; an *atom* is a module whose call lies within one stage
while its caller's spans several (the model itself, its `model`, ...: glue that runs on every
stage). The second run runs the atoms again, on fake tensors, through the same dispatch a stage
uses, and keys every value of the glue by what it is (capture/identity.py), following which
stages each derives from; capture/routes.py then finds what each stage needs of the others.
"""

from __future__ import annotations

import bisect
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from gpipe_fast.capture.copies import ShapeRules, planning_copy
from gpipe_fast.capture.dispatch import install, running
from gpipe_fast.capture.identity import Identities
from gpipe_fast.capture.plan import CapturePlan, Route
from gpipe_fast.capture.planner import Planner
from gpipe_fast.capture.routes import find_routes

Inputs = tuple[tuple[Any, ...], dict[str, Any]]  # a forward's (args, kwargs)


def as_inputs(example: Any, what: str = "example_inputs") -> Inputs:
    """A forward's (args, kwargs) from a tensor, a tuple of positional arguments or a dict of
    keyword arguments."""
    if isinstance(example, Tensor):
        return (example,), {}
    if isinstance(example, tuple):
        return example, {}
    if isinstance(example, dict):
        if not all(isinstance(name, str) for name in example):
            raise TypeError(f"{what}: a dict's keys must be the forward's argument names")
        return (), dict(example)
    raise TypeError(
        f"{what} must be a Tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments, got {type(example).__name__}"
    )


@dataclass
class _Event:
    """One module call of the first run."""

    module: nn.Module
    start: int
    parent: int | None
    end: int = -1  # the start of the last call inside it (itself when it calls none)


@dataclass
class _Recorder:
    """Module calls of the model's modules, by hooks on the planning copy's own modules."""

    events: list[_Event] = field(default_factory=list)
    stack: list[int] = field(default_factory=list)
    failed_in: int | None = None  # the innermost call an exception left

    def pre(self, module: nn.Module, args: Any) -> None:
        parent = self.stack[-1] if self.stack else None
        self.events.append(_Event(module, len(self.events), parent))
        self.stack.append(len(self.events) - 1)

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        index = self.stack.pop()
        if sys.exc_info()[0] is not None and self.failed_in is None:
            self.failed_in = index  # unwinding: the innermost module it left is where
        self.events[index].end = len(self.events) - 1


def _record(model: nn.Module, inputs: Inputs) -> list[_Event]:
    """Every module call of one forward of `model` (a planning copy), in order."""
    recorder = _Recorder()
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(recorder.pre))
        handles.append(module.register_forward_hook(recorder.post, always_call=True))
    try:
        with torch.no_grad():
            model(*inputs[0], **inputs[1])
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise ValueError(_reads_values(model, recorder, error)) from error
    except RuntimeError as error:
        if not str(error).startswith("_apply(): Couldn't swap"):
            raise
        raise ValueError(
            f"gpipe_fast.pipeline: the model's forward converts its own module's parameters "
            f"({error}) {_where(model, recorder)}: a pipe plans the forward, and makes the "
            "placeholders of other stages' modules, on copies whose tensors are fake, which "
            "torch cannot convert so; convert the model before building the pipe"
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    return recorder.events


# transformers' experts kernels, for the refusal of those that read values on the host.
_EXPERTS_ADVICE = (
    " A transformers MoE model's 'eager' experts kernel picks each expert's tokens on the "
    "host; the 'batched_mm' and 'grouped_mm' kernels compute on shapes alone: "
    "model.set_experts_implementation('batched_mm') (exact in any dtype) or 'grouped_mm'."
)


def _inner(recorder: _Recorder) -> int | None:
    """The innermost module call an exception left (or is in)."""
    if recorder.failed_in is not None:
        return recorder.failed_in
    return recorder.stack[-1] if recorder.stack else None


def _where(model: nn.Module, recorder: _Recorder) -> str:
    """Where among the module calls the first run failed: inside which, after which."""
    names = _names(model)
    events, inner = recorder.events, _inner(recorder)
    parts = []
    if inner is not None and events[inner].parent is not None:
        parts.append(f"inside {names[id(events[inner].module)]!r}")
    if events and (inner is None or events[-1].start != inner):
        parts.append(f"after {names[id(events[-1].module)]!r} returned")
    return ", ".join(parts) or "before its first module call"


def _reads_values(model: nn.Module, recorder: _Recorder, error: Exception) -> str:
    """Why a forward that reads a tensor's values on the host cannot be planned, and where."""
    where = _where(model, recorder)
    inner = _inner(recorder)
    kinds = [type(recorder.events[inner].module).__name__.lower()] if inner is not None else []
    experts = any("experts" in kind or "moe" in kind for kind in kinds)
    return (
        f"gpipe_fast.pipeline: the model's forward reads a tensor's values on the host {where} "
        f"({error}): .item(), a Python branch on a tensor, or an op whose output's shape "
        "depends on values. The pipe is planned on shapes alone (fake tensors), and a stage "
        "holds only placeholders for what other stages compute, so it refuses such a forward "
        "rather than guess. Compute that value before calling the model and pass it as an "
        "input, or pipeline an nn.Sequential with gf.GPipe." + (_EXPERTS_ADVICE if experts else "")
    )


def _names(model: nn.Module) -> dict[int, str]:
    """Each module's name (the first, where a module has several), by id."""
    names: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), name)
    return names


def repeated_blocks(model: nn.Module) -> list[str]:
    """The names of the modules in the model's ModuleLists (`model.layers.3`, `h.0`...): where
    split points usually go."""
    return [
        f"{name}.{child}" if name else child
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        for child in module._modules
    ]


def _candidates(model: nn.Module) -> str:
    blocks = repeated_blocks(model)
    shown = ", ".join(repr(b) for b in blocks[:8]) + (", ..." if len(blocks) > 8 else "")
    return f"the model's repeated blocks: {shown}" if blocks else "a name of model.named_modules()"


def _boundaries(model: nn.Module, events: list[_Event], split_points: list[str]) -> list[int]:
    """The first call of each split point's module, checked: it names a module, the forward
    calls it, and the points come in call order."""
    firsts: dict[int, int] = {}
    for event in events:
        firsts.setdefault(id(event.module), event.start)
    starts = []
    for name in split_points:
        if not isinstance(name, str):
            raise TypeError(f"split_points: {name!r} is not a module's name (str)")
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"split_points: {name!r} names no module of the model; try {_candidates(model)}"
            ) from None
        if id(module) not in firsts:
            raise ValueError(
                f"split_points: the model's forward never calls {name!r} on the example "
                f"inputs; try {_candidates(model)}"
            )
        starts.append(firsts[id(module)])
    if starts != sorted(set(starts)) or (starts and starts[0] == 0):
        raise ValueError(
            f"split_points {split_points!r} must be modules where a new stage begins, each "
            "called after the one before (in the order the forward calls them)"
        )
    return starts


def _atoms(
    events: list[_Event], starts: list[int], names: dict[int, str]
) -> tuple[list[int], set[int]]:
    """The atoms' calls (event indices, in order): calls within one stage whose caller spans
    several stages (the model's own call spans all of them); and the glue modules (by id)."""

    def stage(index: int) -> int:
        return bisect.bisect_right(starts, index)

    atoms: list[int] = []
    roles: dict[int, str] = {}
    for event in events:
        whole = stage(event.start) == stage(event.end)
        parent = events[event.parent] if event.parent is not None else None
        spanning_parent = parent is None or stage(parent.start) != stage(parent.end)
        if not spanning_parent:
            continue  # inside an atom
        role = "atom" if whole and parent is not None else "glue"
        # A module called in several stages is held by each (its parameters are then tied),
        # but not one whose call is an atom once and glue another time.
        if roles.setdefault(id(event.module), role) != role:
            raise ValueError(
                f"gpipe_fast.pipeline: {names[id(event.module)]!r} is called both within one "
                "stage and across a split point; move the split points so that every call "
                "of it lies within one stage"
            )
        if role == "atom":
            atoms.append(event.start)
    return atoms, {module for module, role in roles.items() if role == "glue"}


def discover(
    model: nn.Module, example: Any, split_points: list[str], training: bool | None = None
) -> CapturePlan:
    """The plan of `model` cut at `split_points`, from two runs of its forward on fake
    tensors shaped as `example` (one micro-batch), in training mode or not (default: the
    model's): cheap in memory whatever the model's size, and the model may be on the meta
    device."""
    args, kwargs = as_inputs(example)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # The inputs stay real, as on every stage (each has them): what the forward computes from
    # them alone (masks, positions, checks that skip fake tensors) it computes for real, as
    # the stages will; only what the model's own tensors enter is fake. A model on the meta
    # device is planned all fake instead (its glue would mix meta and real tensors).
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    model = planning_copy(model, mode)
    if training is not None:
        model.train(training)
    names = _names(model)

    def fake(inputs: Inputs) -> Inputs:
        if not on_meta:
            return inputs
        return pytree.tree_map_only(Tensor, mode.from_tensor, inputs)  # type: ignore[no-any-return]

    identities = Identities()
    with mode if on_meta else nullcontext(), ShapeRules():
        events = _record(model, fake((args, kwargs)))
        starts = _boundaries(model, events, list(split_points))
        atom_starts, glue = _atoms(events, starts, names)
        stages = [bisect.bisect_right(starts, s) for s in atom_starts]
        atoms = [events[s] for s in atom_starts]
        count = len(starts) + 1
        empty = sorted(set(range(count)) - set(stages))
        if empty and count > 1:
            raise ValueError(
                f"split_points {list(split_points)!r} must be modules where a new stage begins, "
                f"each called after the one before: stage {empty[0]} would run no module of its "
                "own (a split point at the first module the forward calls leaves stage 0 empty)"
            )
        planner = Planner(model, [a.module for a in atoms], stages, count, names, identities)
        install(a.module for a in atoms)
        fake_args, fake_kwargs = fake((args, kwargs))
        named = {str(i): a for i, a in enumerate(fake_args)} | fake_kwargs
        planner.inputs({n: t for n, t in named.items() if isinstance(t, Tensor)})
        try:
            with running(planner), planner.enter(), torch.set_grad_enabled(model.training):
                output = model(*fake_args, **fake_kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as error:
            raise ValueError(
                f"gpipe_fast.pipeline: the model's forward reads a tensor's values on the host "
                f"{planner._where()} ({error}); see the first run's message for why this is "
                "refused"
            ) from error
        if len(planner.calls) != len(atoms):
            raise RuntimeError("gpipe_fast.pipeline: the second run called fewer modules")
        for j, leaf in enumerate(pytree.tree_leaves(output)):
            if isinstance(leaf, Tensor):
                planner.needs.add(
                    count - 1, planner.key_of(leaf), f"leaf {j} of the model's output"
                )
    routes, reads = find_routes(planner.values, planner.needs, planner.stale)
    plan = _plan(planner, routes, reads, count, args, kwargs, model.training)
    plan.cache = _cache_in(output)
    plan.glue = sorted(names[g] for g in glue)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    plan.atoms = [
        sorted({c.fqn for c in plan.calls if c.stage == k}, key=order.__getitem__)
        for k in range(plan.stages)
    ]  # in the model's order, so that the pipe lists its parameters as the model does
    return plan


def _cache_in(output: Any) -> str:
    """The name of a KV cache's class in the output (transformers' use_cache=True), or ""."""
    for leaf in pytree.tree_leaves(output):
        kind = type(leaf)
        if kind.__module__.startswith("transformers") and kind.__name__.endswith("Cache"):
            return kind.__name__
    return ""


def _plan(planner: Planner, routes: Any, reads: list[list[str]], count: int,
          args: tuple[Any, ...], kwargs: dict[str, Any],
          training: bool) -> CapturePlan:  # fmt: skip
    inputs = {str(i): a for i, a in enumerate(args)} | kwargs
    tensor_inputs = [n for n, v in inputs.items() if isinstance(v, Tensor)]
    constants = {n: v for n, v in inputs.items() if not isinstance(v, Tensor)}
    nested = [n for n, v in constants.items() if any(
        isinstance(leaf, Tensor) for leaf in pytree.tree_leaves(v))]  # fmt: skip
    if nested:
        raise TypeError(
            f"example_inputs: {nested[0]!r} holds tensors inside another value; give each "
            "tensor as an argument of its own"
        )
    plan = CapturePlan(count, planner.calls, routes, tensor_inputs, constants, len(args), training,
                planner.keys.identities, reads=reads)  # fmt: skip
    plan.values = {r.value: planner.values[r.value] for r in routes.values() if r.value >= 0}
    plan.state_names = sorted(planner.state_seen)
    plan.side_calls = sorted(planner.side_calls)
    for name in tensor_inputs:  # every stage runs the forward on its micro-batch's inputs
        key = plan.input_key(name)
        floating = inputs[name].is_floating_point()
        plan.routes[key] = Route(key, 0, -1, list(range(1, count)), floating, f"input {name!r}")
    return plan

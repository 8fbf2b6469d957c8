"""The plan of a model's pipe: its forward run twice on fake tensors, its module calls staged.

The first run records every module call (its name, where it starts and ends among the calls,
what it returned). Split points cut the calls into stages; an *atom* is a module whose call
lies within one stage while its caller's spans several (the model itself, its `model`, ...:
glue that runs on every stage). The second run replays the atoms' recorded outputs and follows,
through the glue between them, which stages each tensor derives from: an argument of a stage's
atom that another stage computes becomes a route from that stage (its producer) to this one.
"""

from __future__ import annotations

import bisect
import copy
import weakref
from collections.abc import Callable
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
from torch.distributed.tensor import DTensor
from torch.nn.modules import module as torch_module
from torch.overrides import TorchFunctionMode

from gpipe_fast.capture.dispatch import installed, viewing
from gpipe_fast.capture.plan import Call, Plan, Route, Site
from gpipe_fast.nn.compiled import uncompile

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
    output: Any = None


@dataclass
class _Recorder:
    """Module calls of the model's modules (a loss module the forward makes as it goes, say,
    is not one: its call is glue like any function's)."""

    modules: set[int]
    events: list[_Event] = field(default_factory=list)
    stack: list[int] = field(default_factory=list)

    def pre(self, module: nn.Module, args: Any) -> None:
        if id(module) not in self.modules:
            return
        parent = self.stack[-1] if self.stack else None
        self.events.append(_Event(module, len(self.events), parent))
        self.stack.append(len(self.events) - 1)

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) not in self.modules:
            return
        index = self.stack.pop()
        event = self.events[index]
        event.end = len(self.events) - 1
        event.output = output


def fake_memo(model: nn.Module, mode: FakeTensorMode) -> dict[int, Any]:
    """A deepcopy memo that copies each of the model's parameters and buffers as `mode`'s
    fake tensor: a module copied with it computes shapes alone, and writes only to itself."""
    return {id(t): fake_of(t, mode) for t in [*model.parameters(), *model.buffers()]}


def fake_of(tensor: Tensor, mode: FakeTensorMode) -> Tensor:
    """`tensor` as `mode`'s fake tensor; a shard (a DTensor of a sharded stage) as its whole
    tensor, which is what the model's code computes with."""
    if isinstance(tensor, DTensor):
        with mode:
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return mode.from_tensor(tensor)


def planning_copy(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """A copy of `model` whose parameters and buffers are `mode`'s fake tensors, to run its
    forward for shapes: what the forward writes (a BatchNorm's count of batches, any
    attribute) lands in the copy, never in the model. The copy has the model's names."""
    try:
        planned = copy.deepcopy(model, fake_memo(model, mode))
    except Exception as error:
        raise TypeError(
            f"gpipe_fast.pipeline plans on a copy of the model (so that running its forward "
            f"changes nothing in it), and copy.deepcopy failed on it: {error}"
        ) from error
    uncompile(planned)  # shapes need no compiled code (nor a copy running the original)
    return planned


def _record(model: nn.Module, inputs: Inputs) -> list[_Event]:
    """Every module call of one forward, in order, with what each returned."""
    recorder = _Recorder({id(m) for m in model.modules()})
    pre = torch_module.register_module_forward_pre_hook(recorder.pre)
    post = torch_module.register_module_forward_hook(recorder.post, always_call=True)
    try:
        with torch.no_grad():
            model(*inputs[0], **inputs[1])
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise ValueError(_reads_values(model, recorder, error)) from error
    finally:
        pre.remove()
        post.remove()
    return recorder.events


def _reads_values(model: nn.Module, recorder: _Recorder, error: Exception) -> str:
    """Why a forward that reads a tensor's values on the host cannot be planned, and where."""
    names = _names(model)
    if recorder.stack:
        where = f"inside {names[id(recorder.events[recorder.stack[-1]].module)]!r}"
    elif recorder.events:
        where = f"after {names[id(recorder.events[-1].module)]!r} returned"
    else:
        where = "before its first module call"
    return (
        f"gpipe_fast.pipeline: the model's forward reads a tensor's values on the host {where} "
        f"({error}): .item(), a Python branch on a tensor, or an op whose output's shape "
        "depends on values. The pipe is planned on shapes alone (fake tensors), and a stage "
        "holds only placeholders for what other stages compute, so it refuses such a forward "
        "rather than guess. Compute that value before calling the model and pass it as an "
        "input, or pipeline an nn.Sequential with gf.GPipe."
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
        if roles.setdefault(id(event.module), role) != role:
            raise ValueError(
                f"gpipe_fast.pipeline: {names[id(event.module)]!r} is called both within one "
                "stage and across a split point; move the split points so that every call "
                "of it lies within one stage"
            )
        if role == "atom":
            atoms.append(event.start)
    return atoms, {module for module, role in roles.items() if role == "glue"}


class _Dependencies(TorchFunctionMode):
    """Follows which stages each tensor of the glue derives from (an op's outputs derive from
    whatever its inputs did; atoms' outputs are marked by the caller), and where each was
    made: its site and, for a glue op's output, that op's input tensors."""

    def __init__(self, calls: Callable[[], int]) -> None:
        super().__init__()
        self._of: dict[int, tuple[weakref.ref[Tensor], frozenset[int]]] = {}
        self._made: dict[int, tuple[Tensor, Site, list[Tensor]]] = {}
        self.ops = 0  # the glue's torch calls so far (counted alike when the stages run)
        self.calls_before_op: dict[int, int] = {}
        self._calls = calls

    def of(self, tensor: Tensor) -> frozenset[int]:
        found = self._of.get(id(tensor))
        if found is None or found[0]() is not tensor:
            return frozenset()
        return found[1]

    def made(self, tensor: Tensor) -> tuple[Site, list[Tensor]] | None:
        found = self._made.get(id(tensor))
        return None if found is None or found[0] is not tensor else found[1:]

    def mark(self, tree: Any, stages: frozenset[int], site: tuple[str, int] | None = None,
             inputs: list[Tensor] | None = None) -> None:  # fmt: skip
        for j, leaf in enumerate(pytree.tree_leaves(tree)):
            if not isinstance(leaf, Tensor):
                continue
            if stages:
                self._of[id(leaf)] = (weakref.ref(leaf), stages | self.of(leaf))
            if site is not None:  # the latest: an atom may return its input (dropout p=0)
                self._made[id(leaf)] = (leaf, (site[0], site[1], j), inputs or [])

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = self.ops
        self.ops += 1
        self.calls_before_op[op] = self._calls()
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        stages = frozenset().union(*(self.of(t) for t in inputs))
        self.mark(out, stages, ("op", op), inputs)
        return out


class _Follow:
    """The second run's view: each atom call returns what it returned in the first run, and
    what the stages need of each other makes the plan's routes."""

    def __init__(
        self, atoms: list[_Event], stages: list[int], names: dict[int, str], count: int
    ) -> None:
        self.atoms, self.stages, self.names, self.count = atoms, stages, names, count
        self.deps = _Dependencies(lambda: len(self.calls))
        self.calls: list[Call] = []
        self.routes: dict[str, Route] = {}
        self._by_tensor: dict[int, tuple[Tensor, str]] = {}

    def need(
        self, leaf: Tensor, consumer: int, site: Site, what: str, seen: set[int] | None = None
    ) -> None:
        """`consumer` uses `leaf` at `site`: where another stage computes it, a route takes it
        there; where it combines several stages' values, the consumer computes it from
        routed ingredients."""
        seen = set() if seen is None else seen
        if id(leaf) in seen:
            return
        seen.add(id(leaf))
        stages = self.deps.of(leaf)
        foreign = stages - {consumer}
        if not foreign:
            return
        if len(stages) == 1:
            (producer,) = foreign
            self._route(leaf, producer, consumer, site)
            return
        made = self.deps.made(leaf)
        if made is None or made[0][0] != "op":
            raise ValueError(
                f"gpipe_fast.pipeline: {what} (stage {consumer}) combines values of stages "
                f"{sorted(stages)} where no single operation does; move the split points so "
                "that one stage computes it"
            )
        for ingredient in made[1]:  # this stage computes it from what it is made of
            ingredient_made = self.deps.made(ingredient)
            if ingredient_made is not None and len(self.deps.of(ingredient) - {consumer}):
                self.need(ingredient, consumer, ingredient_made[0], what, seen)

    def _route(self, leaf: Tensor, producer: int, consumer: int, site: Site) -> None:
        """The route of `leaf` (one per tensor, however many stages and sites take it),
        captured where it was made (an atom's output, a glue op's) or at its first use."""
        found = self._by_tensor.get(id(leaf))
        if found is not None and found[0] is leaf:
            route = self.routes[found[1]]
        else:
            made = self.deps.made(leaf)
            capture = made[0] if made is not None else site
            route = Route(f"v{len(self.routes)}", producer, leaf.is_floating_point(), capture)
            self.routes[route.key] = route
            self._by_tensor[id(leaf)] = (leaf, route.key)
        made = self.deps.made(leaf)
        # Put where it was last made (an atom passing its input on makes it again there; on
        # the consumer that atom returns a placeholder), or where it is used.
        deliver = site if made is None else made[0]
        sites = route.deliver.setdefault(consumer, [])
        if deliver not in sites:
            sites.append(deliver)

    def __call__(
        self, module: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        i = len(self.calls)
        if i >= len(self.atoms) or self.atoms[i].module is not module:
            raise RuntimeError(
                "gpipe_fast.pipeline: the model's forward called its modules in another order "
                "on a second run with the same inputs (its control flow is not repeatable)"
            )
        stage = self.stages[i]
        name = self.names[id(module)]
        self.calls.append(Call(i, name, stage))
        for j, leaf in enumerate(pytree.tree_leaves((args, kwargs))):
            if isinstance(leaf, Tensor):
                self.need(leaf, stage, ("arg", i, j), f"argument {j} of {name!r}")
        output = self.atoms[i].output
        self.deps.mark(output, frozenset({stage}), ("out", i))
        return output


def discover(model: nn.Module, example: Any, split_points: list[str]) -> Plan:
    """The plan of `model` cut at `split_points`, from two runs of its forward on fake
    tensors shaped as `example` (one micro-batch): cheap in memory whatever the model's size,
    and the model may be on the meta device."""
    args, kwargs = as_inputs(example)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = planning_copy(model, mode)
    names = _names(model)

    def fake(inputs: Inputs) -> Inputs:
        return pytree.tree_map_only(Tensor, mode.from_tensor, inputs)  # type: ignore[no-any-return]

    with mode:
        events = _record(model, fake((args, kwargs)))
        starts = _boundaries(model, events, list(split_points))
        atom_starts, glue = _atoms(events, starts, names)
        stages = [bisect.bisect_right(starts, s) for s in atom_starts]
        atoms = [events[s] for s in atom_starts]
        _check_glue_owns_nothing(model, glue, names)
        follow = _Follow(atoms, stages, names, len(starts) + 1)
        atom_modules = {id(a.module): a.module for a in atoms}
        fake_args, fake_kwargs = fake((args, kwargs))
        with installed(atom_modules.values()), viewing(follow), follow.deps, torch.no_grad():
            output = model(*fake_args, **fake_kwargs)
        if len(follow.calls) != len(atoms):
            raise RuntimeError("gpipe_fast.pipeline: the second run called fewer modules")
        plan = _plan(follow, stages, len(starts) + 1, args, kwargs)
        _route_output(plan, follow, output)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    plan.atoms = [
        sorted({c.fqn for c in plan.calls if c.stage == k}, key=order.__getitem__)
        for k in range(plan.stages)
    ]  # in the model's order, so that the pipe lists its parameters as the model does
    _finish(plan, follow.deps.calls_before_op)
    return plan


def _check_glue_owns_nothing(model: nn.Module, glue: set[int], names: dict[int, str]) -> None:
    """Parameters and buffers of glue modules themselves (not of their submodules) would be
    needed on every stage: refused for now."""
    for module in model.modules():
        own = [*module._parameters, *module._buffers]
        if id(module) in glue and own:
            raise ValueError(
                f"gpipe_fast.pipeline: {names[id(module)] or 'the model'!r} holds "
                f"{', '.join(own)} itself and its forward spans several stages; move them into "
                "a submodule, or the split points so that its call lies within one stage"
            )


def _plan(follow: _Follow, stages: list[int], count: int, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> Plan:  # fmt: skip
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
    plan = Plan(count, follow.calls, follow.routes, tensor_inputs, constants, len(args))
    for name in tensor_inputs:  # every stage runs the forward on its micro-batch's inputs
        key = plan.input_key(name)
        route = Route(key, 0, inputs[name].is_floating_point(), ("input", -1, -1))
        route.deliver = {k: [] for k in range(1, count)}
        plan.routes[key] = route
    return plan


def _route_output(plan: Plan, follow: _Follow, output: Any) -> None:
    """The output's leaves that another stage than the last computes reach the last one."""
    last = plan.stages - 1
    for j, leaf in enumerate(pytree.tree_leaves(output)):
        if isinstance(leaf, Tensor):
            follow.need(leaf, last, ("end", -1, j), f"leaf {j} of the model's output")


def _finish(plan: Plan, calls_before_op: dict[int, int]) -> None:
    """The glue ops that sites name, and each stage's last call to reach: its own last, or
    where it takes a value for another."""
    sites = [r.capture for r in plan.routes.values()]
    sites += [site for r in plan.routes.values() for put in r.deliver.values() for site in put]
    plan.calls_before_op = {at: calls_before_op[at] for kind, at, _ in sites if kind == "op"}
    plan.last_needed = [-1] * plan.stages
    for call in plan.calls:
        plan.last_needed[call.stage] = max(plan.last_needed[call.stage], call.index)
    for route in plan.routes.values():
        if route.capture[0] != "input":
            reach = plan.reach(route.capture)
            plan.last_needed[route.producer] = max(plan.last_needed[route.producer], reach)
    plan.last_needed[-1] = len(plan.calls)

"""One stage of a model cut by its plan: the model's own forward, this stage's atoms for real.

Every stage runs the whole forward of the model (its glue is cheap) with its own micro-batch
of the inputs. Its own atoms run for real, hooks and all; every other atom returns a fake
placeholder of the shape it would have returned (capture/placeholders.py), and fires no hook,
so that the glue between them runs as written. Each value another stage needs is taken where
this stage makes it, each value this stage receives is put where it makes its placeholder of
it, matched by identity (capture/identity.py) and checked (shape and dtype) as it is put. The
forward stops once this stage has done all it must (the last stage runs to the end and
returns the model's output). Glue that would read a placeholder's values (`.item()`, control
flow on data) fails loudly: a stage never computes with another stage's values that it does
not have.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)

from gpipe_fast.capture.dispatch import current, install, run_eagerly_in_runs, running
from gpipe_fast.capture.identity import Key, KeyedRun, rebuilt, replace
from gpipe_fast.capture.placeholders import Placeholders
from gpipe_fast.capture.plan import Plan
from gpipe_fast.capture.plans import Plans
from gpipe_fast.skip.skippable import pop, skippable, stash


class _StageDone(BaseException):
    """Raised through the model's forward once a stage has done all it must (a BaseException,
    so that the model's own `except Exception` lets it through)."""


class _StageRun(KeyedRun):
    """One forward of the model on one stage: its atom calls and, when its plan takes or puts
    values that glue ops make, its glue ops, keyed."""

    def __init__(self, cell: StageCell, plan: Plan, received: dict[str, Tensor | None],
                 inputs: dict[str, Tensor]) -> None:  # fmt: skip
        super().__init__(plan.identities, add=False)
        self.cell, self.plan, self.stage = cell, plan, cell.stage
        self.received = received
        sites = cell.sites(plan)
        self.takes, self.puts, self.out_calls = sites.takes, sites.puts, sites.out_calls
        self.wanted = sites.wanted
        self.captured: dict[str, Tensor | None] = {}
        self.atom_modules = cell.atom_modules(plan)
        self.atom_ids = cell.atom_ids(plan)
        self.next = 0
        self.own_left = sites.own_calls
        self.current_call: int | None = None
        self.sub_calls: dict[str, int] = {}
        self.substitutes = cell.substitutes(plan)
        self.glue = sites.glue_ops or bool(self.substitutes)
        if self.glue:
            self._key_what_every_stage_has(inputs)

    def _key_what_every_stage_has(self, inputs: dict[str, Tensor]) -> None:
        keys = self.keys
        for name, tensor in inputs.items():
            keys.set(tensor, keys.intern(("input", name)))
        model = self.cell._model
        for name in self.plan.state_names:
            found = _tensor_at(model, name)
            if found is not None:
                key = keys.intern(("state", name))
                keys.set(found, key)
                own = self.substitutes.get(id(found))
                if own is not None:
                    keys.set(own, key)

    # -- atoms -------------------------------------------------------------------------------

    def dispatches(self, module: nn.Module) -> bool:
        return id(module) in self.atom_ids

    def atom(self, module: nn.Module, args: Any, kwargs: Any, call: Callable[..., Any]) -> Any:
        plan, i = self.plan, self.next
        if i >= len(plan.calls) or self.atom_modules[i] is not module:
            expected = repr(plan.calls[i].fqn) if i < len(plan.calls) else "no more modules"
            raise RuntimeError(
                f"gpipe_fast.pipeline: on stage {self.stage} the model's forward called "
                f"{self.cell.name_of(module)!r} where its plan has {expected} (call {i}): its "
                "control flow depends on the input's values, which each stage does not have, "
                "or differs from when the pipe was planned"
            )
        self.next = i + 1
        fqn = plan.calls[i].fqn
        self.current_call, self.sub_calls, start = i, {}, self.keys.stamp
        try:
            with self.suspended():
                if self.substitutes:
                    args, kwargs = (
                        replace(args, self.substitutes),
                        replace(kwargs, self.substitutes),
                    )
                if plan.calls[i].stage == self.stage:
                    _check_real((args, kwargs), f"an argument of {fqn!r} (call {i})", self.stage)
                    out = call(*args, **kwargs)
                    self.own_left -= 1
                else:
                    fresh = i in self.cell.side_calls(plan)
                    out = self.cell.placeholders.output(
                        i, fqn, module, args, kwargs, plan.training, fresh
                    )
        finally:
            self.current_call = None
        if self.glue or i in self.out_calls:
            given = {id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
            out = self._atom_output(i, out, given, start)
        self._check_done()
        return out

    def _atom_output(self, i: int, out: Any, given: set[int], start: int) -> Any:
        """The call's output, its leaves keyed, taken or put; a value it got and passes on
        stays what it was (as in the plan)."""
        leaves, spec = pytree.tree_flatten(out)
        changed = False
        for j, leaf in enumerate(leaves):
            passed = id(leaf) in given or (self.glue and self.keys.made_by(leaf, start))
            if isinstance(leaf, Tensor) and not passed:
                key = self.keys.intern(("out", i, j))
                if self.glue:
                    self.keys.set(leaf, key)
                new = self._sites(key, leaf)
                if new is not leaf:
                    leaves[j], changed = new, True
        return pytree.tree_unflatten(leaves, spec) if changed else out

    def side_output(self, module_name: str, output: Any, deliver: bool) -> Any:
        """An output of a module inside the atom call now running (hooked): taken for another
        stage, or (`deliver`: in a placeholder's shadow) put from the one that made it."""
        i = self.current_call
        if i is None:
            return None
        nth = self.sub_calls[module_name] = self.sub_calls.get(module_name, -1) + 1
        leaves, spec = pytree.tree_flatten(output)
        changed = False
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor):
                key = self.keys.intern(("sub", i, module_name, nth, j))
                if key is None:
                    continue
                if deliver and key in self.puts:
                    leaves[j], changed = self._put(key, leaf), True
                elif not deliver and key in self.takes:
                    self._take(key, leaf)
                if self.glue:
                    self.keys.set(leaves[j], key)
        return pytree.tree_unflatten(leaves, spec) if changed else None

    # -- glue ops ----------------------------------------------------------------------------

    def after_op(
        self, name: str, inputs: tuple[Key, ...], out: Any, leaves: list[Tensor | None],
        made: list[tuple[int, Tensor, Key]],
    ) -> Any:  # fmt: skip
        changed = False
        for j, tensor, key in made:
            new = self._sites(key, tensor)
            if new is not tensor and j >= 0:
                leaves[j], changed = new, True
        if changed:
            out = rebuilt(out, leaves)
        self._check_done()
        return out

    # -- taking and putting ------------------------------------------------------------------

    def _sites(self, key: Key, tensor: Tensor) -> Tensor:
        if key is None or (key not in self.puts and key not in self.takes):
            return tensor
        value = self.plan.values[key]
        if value.kind == "op" and value.call != self.next:
            raise RuntimeError(
                f"gpipe_fast.pipeline: on stage {self.stage} the model's forward makes "
                f"{value.what} after {self.next} module calls, where its plan has it after "
                f"{value.call}: the stages' runs of the forward differ from the plan's"
            )
        if key in self.puts:
            tensor = self._put(key, tensor)
            if self.glue:
                self.keys.set(tensor, key)
        if key in self.takes:
            self._take(key, tensor)
        return tensor

    def _put(self, key: int, stand_in: Tensor) -> Tensor:
        route = self.puts[key]
        value = self.received.get(route)
        what = self.plan.values[key].what
        if not isinstance(value, Tensor):
            raise RuntimeError(f"gpipe_fast.pipeline: stage {self.stage} received no value for "
                               f"{what} (route {route})")  # fmt: skip
        if value.shape != stand_in.shape or value.dtype != stand_in.dtype:
            raise RuntimeError(
                f"gpipe_fast.pipeline: stage {self.stage} received {what} as "
                f"{tuple(value.shape)} {value.dtype}, where its own run of the forward makes "
                f"{tuple(stand_in.shape)} {stand_in.dtype}: the stages' runs of the forward "
                "differ (a branch on the stage's own values?)"
            )
        return value

    def _take(self, key: int, tensor: Tensor) -> None:
        route = self.takes[key]
        if isinstance(tensor, FakeTensor):
            value = self.plan.values[key]
            raise RuntimeError(
                f"gpipe_fast.pipeline: stage {self.stage} must send {value.what} to stage(s) "
                f"{self.plan.routes[route].consumers}, but its run of the forward makes it "
                "from placeholders of other stages' values: the forward took another path than "
                "when the pipe was planned"
            )
        self.captured[route] = tensor

    def _check_done(self) -> None:
        if not self.cell.last and self.own_left == 0 and len(self.captured) == self.wanted:
            raise _StageDone

    def finish(self) -> None:
        """After the forward: every value this stage sends was taken."""
        missing = [self.plan.values[k].what for k, r in self.takes.items()
                   if r not in self.captured]  # fmt: skip
        if missing or (self.own_left and not self.cell.last):
            lost = "; ".join(missing) or f"{self.own_left} of its own module calls"
            raise RuntimeError(
                f"gpipe_fast.pipeline: stage {self.stage}'s run of the model's forward ended "
                f"without making {lost}, which its plan sends to other stages: the forward "
                "took another path than when the pipe was planned (another mode, other "
                "constant inputs, a branch on shapes?)"
            )

    def where(self) -> str:
        if self.next == 0:
            return "before its first module call"
        call = self.plan.calls[self.next - 1]
        return f"after {call.fqn!r} (call {call.index}) was called"


@dataclass(frozen=True)
class _Sites:
    """What one stage takes and puts under one plan (value key -> route key), found once."""

    takes: dict[int, str]
    puts: dict[int, str]
    wanted: int  # how many routes it takes for others
    own_calls: int  # how many of its calls are its own atoms'
    out_calls: frozenset[int]  # the calls whose outputs it takes or puts
    glue_ops: bool  # whether it takes or puts a value a glue op makes (it keys the glue then)

    @classmethod
    def of(cls, plan: Plan, stage: int) -> _Sites:
        takes, puts = plan.takes(stage), plan.puts(stage)
        values = [plan.values[k] for k in (*takes, *puts)]
        return cls(
            takes, puts, len(set(takes.values())), plan.own_calls(stage),
            frozenset(v.call for v in values if v.kind == "out"),
            any(v.kind == "op" for v in values),
        )  # fmt: skip


class StageCell(nn.Module):
    """Stage `stage` of `model` cut by `plans`: the layer of one cell (made skippable per stage
    by stage_cells). Its submodules are the stage's atoms at their places in the model, and
    the parameters and buffers its glue reads (so its tensors keep the model's names); the
    model itself is held but not registered."""

    def __init__(self, model: nn.Module, plans: Plans, stage: int, extra: list[str]) -> None:
        super().__init__()
        plan = plans.first
        self.plans = plans
        self.stage = stage
        self.last = stage == plan.stages - 1
        self.present = list(plan.tensor_inputs)  # stage 0: the inputs of the current step
        # The last stage: keywords of the model's forward set for a step (its loss's count,
        # num_items_in_batch), over any given as inputs.
        self.loss_kwargs: dict[str, Any] = {}
        self.__dict__["_model"] = model  # not a submodule: each cell holds only its atoms
        self._model: nn.Module
        for fqn in plan.atoms[stage]:
            _place(self, fqn, model.get_submodule(fqn))
        for name in [*plan.reads[stage], *extra]:
            _place_tensor(self, model, name)
        self._hold_under_first_names(model)
        self.placeholders = Placeholders(model)
        self.placeholders.on_shadow = self._hook_shadow
        self._atoms: dict[int, list[nn.Module]] = {}
        self._sides: dict[int, set[int]] = {}
        self._sites: dict[int, _Sites] = {}
        self._atom_ids: dict[int, frozenset[int]] = {}
        self._hooked: set[tuple[str, bool]] = set()
        consumed = plan.consumed_by(stage)
        # From the stage just before: the boundary value; from further back: skips.
        self.pops = sorted((r.key, _skip_name(r.key, stage)) for r in consumed
                           if r.producer != stage - 1)  # fmt: skip
        self.stashes = sorted((r.key, _skip_name(r.key, t)) for r in plan.produced_by(stage)
                              for t in r.consumers if t > stage + 1)  # fmt: skip
        self.passes = sorted(r.key for r in plan.produced_by(stage) if stage + 1 in r.consumers)
        self.atom_modules(plan)

    def _hold_under_first_names(self, model: nn.Module) -> None:
        """Each parameter of the stage also at the model's first name for it (GPT-2's head,
        alone on the last stage, is `transformer.wte.weight` there too), so that the plain
        model's names reach it on every stage."""
        first: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            first.setdefault(id(param), name)
        for name, param in list(self.named_parameters(remove_duplicate=False)):
            plain = first.get(id(param), name)
            if plain != name and _tensor_at(self, plain) is None:
                _place_tensor(self, model, plain)

    def sites(self, plan: Plan) -> _Sites:
        found = self._sites.get(id(plan))
        if found is None:
            found = self._sites[id(plan)] = _Sites.of(plan, self.stage)
        return found

    def atom_modules(self, plan: Plan) -> list[nn.Module]:
        """The modules of `plan`'s calls, given the dispatching call."""
        found = self._atoms.get(id(plan))
        if found is None:
            found = [self._model.get_submodule(call.fqn) for call in plan.calls]
            install(found)
            run_eagerly_in_runs(self._model, found)
            self._hook_side_outputs(plan)
            self._atoms[id(plan)] = found
        return found

    def atom_ids(self, plan: Plan) -> frozenset[int]:
        found = self._atom_ids.get(id(plan))
        if found is None:
            found = self._atom_ids[id(plan)] = frozenset(map(id, self.atom_modules(plan)))
        return found

    def side_calls(self, plan: Plan) -> set[int]:
        """The calls whose placeholders must run again each time: the glue reads outputs of
        modules inside them (recorded by the model's own hooks, which then run alike)."""
        found = self._sides.get(id(plan))
        if found is None:
            found = self._sides[id(plan)] = set(plan.side_calls)
        return found

    def _hook_side_outputs(self, plan: Plan) -> None:
        """Hooks on the real modules whose outputs this stage takes from inside its atoms."""
        for key in plan.takes(self.stage):
            value = plan.values[key]
            if value.kind == "sub" and (value.name, False) not in self._hooked:
                self._hooked.add((value.name, False))
                self._model.get_submodule(value.name).register_forward_hook(
                    _side_hook(self, value.name, deliver=False)
                )

    def _hook_shadow(self, fqn: str, shadow: nn.Module) -> None:
        """Hooks on a new shadow's modules whose outputs this stage receives (in any mode)."""
        names = {plan.values[k].name for plan in self.plans.all()
                 for k in plan.puts(self.stage) if plan.values[k].kind == "sub"}  # fmt: skip
        for name, module in shadow.named_modules():
            full = f"{fqn}.{name}" if name else fqn
            if full in names:
                module.register_forward_hook(_side_hook(self, full, deliver=True), prepend=True)

    def substitutes(self, plan: Plan) -> dict[int, Tensor]:
        """The model's tensors its glue reads that this stage holds another copy of (a
        replica on its device, a tensor given memory here): model's (by id) -> stage's."""
        found: dict[int, Tensor] = {}
        for name in plan.reads[self.stage]:
            model_tensor, own = _tensor_at(self._model, name), _tensor_at(self, name)
            if model_tensor is not None and own is not None and own is not model_tensor:
                found[id(model_tensor)] = own
        return found

    def name_of(self, module: nn.Module) -> str:
        for name, found in self._model.named_modules():
            if found is module:
                return name or "the model"
        return type(module).__name__

    def forward(self, value: Any):  # type: ignore[no-untyped-def]
        plan = self.plans.get(self._model.training)
        received: dict[str, Tensor | None]
        if self.stage == 0:  # the inputs the step was given (others are None)
            given = value if isinstance(value, tuple) else (value,)
            received = dict.fromkeys(map(plan.input_key, plan.tensor_inputs))
            present = zip(self.present, given, strict=True)
            received.update((plan.input_key(name), tensor) for name, tensor in present)
        else:
            received = dict(value)
        for key, name in self.pops:
            received[key] = yield pop(name)
        args, kwargs, inputs = _inputs(plan, received)
        if self.last and self.loss_kwargs:
            kwargs.update(self.loss_kwargs)
        run = _StageRun(self, plan, received, inputs)
        output = None
        with running(run), run.enter() if run.glue else nullcontext():
            try:
                output = self._model(*args, **kwargs)
            except _StageDone:
                pass
            except (DataDependentOutputException, DynamicOutputShapeException) as error:
                inside = _innermost_module(error, self._model)
                raise RuntimeError(
                    f"gpipe_fast.pipeline: on stage {self.stage} the model's forward reads the "
                    f"values of a tensor{inside} {run.where()} ({error}), and this stage holds "
                    "it only as a placeholder: another stage computes it (a hook that reads "
                    "values on a module that spans stages, or a branch on data the plan did "
                    "not see)"
                ) from error
        run.finish()
        captured = run.captured
        if self.stage == 0:
            captured.update((plan.input_key(n), received[plan.input_key(n)])
                            for n in plan.tensor_inputs)  # fmt: skip
        for key, name in self.stashes:
            yield stash(name, captured[key])
        if self.last:
            return _checked_output(output)
        return {key: captured[key] for key in self.passes}


def _side_hook(cell: StageCell, name: str, deliver: bool) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        run = current()
        if not isinstance(run, _StageRun) or run.cell is not cell:
            return None
        return run.side_output(name, output, deliver)

    return hook


def _innermost_module(error: BaseException, model: nn.Module) -> str:
    """ " inside '<name>'": the innermost of the model's modules whose call (its forward or a
    hook of it) the error left, from its traceback; "" where there is none."""
    names = {id(m): n for n, m in model.named_modules()}
    found = ""
    trace = error.__traceback__
    while trace is not None:
        frame = trace.tb_frame
        if frame.f_code is nn.Module._call_impl.__code__:
            name = names.get(id(frame.f_locals.get("self")))
            if name is not None:
                found = f" inside {name or 'the model'!r} (its forward or a hook of it)"
        trace = trace.tb_next
    return found


def _check_real(tree: Any, what: str, stage: int) -> None:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, FakeTensor):
            raise RuntimeError(
                f"gpipe_fast.pipeline: on stage {stage}, {what} holds a value that another "
                "stage computes and that the plan did not route here (the model's forward "
                "took another path than on the example inputs?)"
            )


def _skip_name(key: str, consumer: int) -> str:
    return f"{key}>{consumer}"


def _inputs(plan: Plan, received: dict[str, Tensor | None]
            ) -> tuple[list[Any], dict[str, Any], dict[str, Tensor]]:  # fmt: skip
    tensors = {n: received[plan.input_key(n)] for n in plan.tensor_inputs}
    values = dict(plan.constant_inputs)
    values.update(tensors)
    args = [values.pop(str(i)) for i in range(plan.positional)]
    return args, values, {n: t for n, t in tensors.items() if t is not None}


def _checked_output(output: Any) -> Any:
    for j, leaf in enumerate(pytree.tree_leaves(output)):
        if isinstance(leaf, FakeTensor):
            raise RuntimeError(
                f"gpipe_fast.pipeline: leaf {j} of the model's output is a placeholder (the "
                "last stage's run of the forward made it from values it does not have)"
            )
    return output


def _tensor_at(root: nn.Module, name: str) -> Tensor | None:
    """The parameter or buffer `name` under `root` (None where there is none)."""
    owner_name, _, attribute = name.rpartition(".")
    try:
        owner = root.get_submodule(owner_name) if owner_name else root
    except AttributeError:
        return None
    found = owner._parameters.get(attribute)
    return found if found is not None else owner._buffers.get(attribute)


def _place(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Puts `module` at `fqn` under `root`, making plain containers on the way."""
    *path, last = fqn.split(".")
    owner = root
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    owner.add_module(last, module)


def _place_tensor(root: nn.Module, model: nn.Module, name: str) -> None:
    """Puts the model's parameter or buffer `name` at its name under `root`, unless a module
    of the stage holds it there already."""
    *path, attribute = name.split(".")
    owner, source = root, model
    for part in path:
        source = source.get_submodule(part)
        child = owner._modules.get(part)
        if child is source:
            return  # a module of the stage holds it
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if source is model and owner is root and attribute in root._modules:
        return
    param = source._parameters.get(attribute)
    if param is not None:
        owner.register_parameter(attribute, param)
        return
    buffer = source._buffers.get(attribute)
    persistent = attribute not in source._non_persistent_buffers_set
    owner.register_buffer(attribute, buffer, persistent=persistent)


def stage_cells(model: nn.Module, plans: Plans) -> list[nn.Module]:
    """The model's stages as cells (each a class of its own, declaring its skips); tensors of
    the model that no stage holds (a module the forward never calls) go with stage 0, so
    that nothing of the model is lost."""
    plan = plans.first
    for name in plan.glue:
        module = model.get_submodule(name)
        if isinstance(module, nn.TransformerEncoder):
            # Its fast path in evaluation packs the batch into a nested tensor for its layers,
            # which a stage cannot hold a placeholder of: off, for the same output (padding
            # positions aside, which the fast path leaves at zero).
            module.use_nested_tensor = False
    extra = _uncovered(model, plan)
    cells: list[nn.Module] = []
    for k in range(plan.stages):
        consumed = [r for r in plan.consumed_by(k) if r.producer != k - 1]
        produced = [(r, t) for r in plan.produced_by(k) for t in r.consumers if t > k + 1]
        cls = skippable(
            stash=[_skip_name(r.key, t) for r, t in produced],
            pop=[_skip_name(r.key, k) for r in consumed],
        )(StageCell)
        cells.append(cls(model, plans, k, extra if k == 0 else []))
    return cells


def _uncovered(model: nn.Module, plan: Plan) -> list[str]:
    """The model's parameters and buffers (by every name they have) that no stage holds under
    that name: neither inside an atom nor read by the glue of a stage."""
    atoms = {fqn for names in plan.atoms for fqn in names}
    read = {name for names in plan.reads for name in names}
    found = []
    for name, _ in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:  # fmt: skip
        parts = name.split(".")
        inside = any(".".join(parts[:n]) in atoms for n in range(1, len(parts)))
        if not inside and name not in read:
            found.append(name)
    return found

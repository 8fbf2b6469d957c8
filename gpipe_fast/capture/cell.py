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
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)

from gpipe_fast.capture.dispatch import current, install, run_eagerly_in_runs, running
from gpipe_fast.capture.placeholders import Placeholders
from gpipe_fast.capture.places import place, place_tensor, tensor_at, uncovered
from gpipe_fast.capture.plan import CapturePlan
from gpipe_fast.capture.plans import CapturePlans
from gpipe_fast.capture.run import Sites, StageDone, StageRun
from gpipe_fast.skip.skippable import pop, skippable, stash


class CapturedCell(nn.Module):
    """Stage `stage` of `model` cut by `plans`: the layer of one cell (made skippable per stage
    by captured_cells). Its submodules are the stage's atoms at their places in the model, and
    the parameters and buffers its glue reads (so its tensors keep the model's names); the
    model itself is held but not registered."""

    def __init__(self, model: nn.Module, plans: CapturePlans, stage: int, extra: list[str]) -> None:
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
            place(self, fqn, model.get_submodule(fqn))
        for name in [*plan.reads[stage], *extra]:
            place_tensor(self, model, name)
        self._hold_under_first_names(model)
        self.placeholders = Placeholders(model)
        self.placeholders.on_shadow = self._hook_shadow
        self._atoms: dict[int, list[nn.Module]] = {}
        self._sides: dict[int, set[int]] = {}
        self._sites: dict[int, Sites] = {}
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
            if plain != name and tensor_at(self, plain) is None:
                place_tensor(self, model, plain)

    def sites(self, plan: CapturePlan) -> Sites:
        found = self._sites.get(id(plan))
        if found is None:
            found = self._sites[id(plan)] = Sites.of(plan, self.stage)
        return found

    def atom_modules(self, plan: CapturePlan) -> list[nn.Module]:
        """The modules of `plan`'s calls, given the dispatching call."""
        found = self._atoms.get(id(plan))
        if found is None:
            found = [self._model.get_submodule(call.fqn) for call in plan.calls]
            install(found)
            run_eagerly_in_runs(self._model, found)
            self._hook_side_outputs(plan)
            self._atoms[id(plan)] = found
        return found

    def atom_ids(self, plan: CapturePlan) -> frozenset[int]:
        found = self._atom_ids.get(id(plan))
        if found is None:
            found = self._atom_ids[id(plan)] = frozenset(map(id, self.atom_modules(plan)))
        return found

    def side_calls(self, plan: CapturePlan) -> set[int]:
        """The calls whose placeholders must run again each time: the glue reads outputs of
        modules inside them (recorded by the model's own hooks, which then run alike)."""
        found = self._sides.get(id(plan))
        if found is None:
            found = self._sides[id(plan)] = set(plan.side_calls)
        return found

    def _hook_side_outputs(self, plan: CapturePlan) -> None:
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

    def substitutes(self, plan: CapturePlan) -> dict[int, Tensor]:
        """The model's tensors its glue reads that this stage holds another copy of (a
        replica on its device, a tensor given memory here): model's (by id) -> stage's."""
        found: dict[int, Tensor] = {}
        for name in plan.reads[self.stage]:
            model_tensor, own = tensor_at(self._model, name), tensor_at(self, name)
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
        run = StageRun(self, plan, received, inputs)
        output = None
        with running(run), run.enter() if run.glue else nullcontext():
            try:
                output = self._model(*args, **kwargs)
            except StageDone:
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


def _side_hook(cell: CapturedCell, name: str, deliver: bool) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        run = current()
        if not isinstance(run, StageRun) or run.cell is not cell:
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


def _skip_name(key: str, consumer: int) -> str:
    return f"{key}>{consumer}"


def _inputs(plan: CapturePlan, received: dict[str, Tensor | None]
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


def captured_cells(model: nn.Module, plans: CapturePlans) -> list[nn.Module]:
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
    extra = uncovered(model, plan)
    cells: list[nn.Module] = []
    for k in range(plan.stages):
        consumed = [r for r in plan.consumed_by(k) if r.producer != k - 1]
        produced = [(r, t) for r in plan.produced_by(k) for t in r.consumers if t > k + 1]
        cls = skippable(
            stash=[_skip_name(r.key, t) for r, t in produced],
            pop=[_skip_name(r.key, k) for r in consumed],
        )(CapturedCell)
        cells.append(cls(model, plans, k, extra if k == 0 else []))
    return cells

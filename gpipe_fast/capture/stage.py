"""One stage of a model cut by its plan: the model's own forward, this stage's atoms for real.

Every stage runs the whole forward of the model (its glue is cheap) with its own micro-batch
of the inputs. Its own atoms run for real, on the values the plan routes to it substituted
for their arguments; every other atom returns a fake placeholder of the shape it would have
returned (FakeTensor: no memory, no compute; run once per shape, then remembered), so that
the glue between them runs as written. What other stages need is captured where the plan
says, and the forward stops once this stage has done all it must (the last stage runs to the
end and returns the model's output). Glue that would read a placeholder's values (`.item()`,
control flow on data) fails loudly: a stage never computes with another stage's values that
it does not have.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

from gpipe_fast.capture.discover import fake_memo, fake_of
from gpipe_fast.capture.dispatch import install, viewing
from gpipe_fast.capture.plan import Plan
from gpipe_fast.skip.skippable import pop, skippable, stash


class _StageDone(BaseException):
    """Raised through the model's forward once a stage has done all it must (a BaseException,
    so that the model's own `except Exception` lets it through)."""


def _describe(leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device)
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return leaf
    return type(leaf).__qualname__


class _Placeholders:
    """Fake outputs of other stages' atoms, per call and argument shapes: the atom runs once
    on fake tensors for each new shape, then its output's shapes are reused. It runs as a
    shadow: a copy of the module whose parameters and buffers (the whole model's, wherever
    the copy reaches them) are fake, so that what its forward writes (a BatchNorm's
    statistics, any attribute) stays in the copy. The module itself belongs to its own stage,
    which may be running it for real at that moment on another thread."""

    def __init__(self, model: nn.Module) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._model = model
        self._memo: dict[int, Any] | None = None  # deepcopy's memo: real tensor id -> fake
        self._shadows: dict[int, nn.Module] = {}
        self._outputs: dict[Any, tuple[list[Any], Any]] = {}

    def _shadow(self, module: nn.Module) -> nn.Module:
        shadow = self._shadows.get(id(module))
        if shadow is None:
            if self._memo is None:
                self._memo = fake_memo(self._model, self.mode)
            # The module's tensors as they are now: a sharded stage's FSDP swaps its modules'
            # parameters between shards and whole tensors as it runs, on its own thread.
            self._memo.update(fake_memo(module, self.mode))
            shadow = copy.deepcopy(module, self._memo)
            _all_fake(shadow, self.mode)
            self._shadows[id(module)] = shadow
        return shadow

    def output(
        self, call: int, module: nn.Module, forward: Callable[..., Any], leaves: list[Any],
        spec: Any,
    ) -> Any:  # fmt: skip
        key = (call, tuple(_describe(leaf) for leaf in leaves))
        found = self._outputs.get(key)
        if found is None:
            stand_in = _stand_in_device(module, leaves)
            if getattr(forward, "__self__", None) is module:  # the module's own method
                forward = types.MethodType(forward.__func__, self._shadow(module))  # type: ignore[attr-defined]
            with self.mode, torch.no_grad():
                fakes = [self.mode.from_tensor(t) if _real(t) else t for t in leaves]
                if stand_in is not None:  # all on meta, as the module's own tensors are
                    fakes = [t.to("meta") if isinstance(t, Tensor) else t for t in fakes]
                args, kwargs = pytree.tree_unflatten(fakes, spec)
                out = forward(*args, **kwargs)
            out_leaves, out_spec = pytree.tree_flatten(out)
            described = [
                _describe(leaf) if isinstance(leaf, Tensor) else leaf for leaf in out_leaves
            ]
            if stand_in is not None:  # what the glue would get from that stage: on this one's
                described = [(d[0], d[1], stand_in) if _is_tensor_description(d) else d
                             for d in described]  # fmt: skip
            found = self._outputs[key] = (described, out_spec)
        described, out_spec = found
        with self.mode:
            made = [
                torch.empty(d[0], dtype=d[1], device=d[2]) if _is_tensor_description(d) else d
                for d in described
            ]
        return pytree.tree_unflatten(made, out_spec)


def _all_fake(module: nn.Module, mode: FakeTensorMode) -> None:
    """Every parameter and buffer of a shadow fake, also one that its stage's FSDP swapped in
    while the copy was being made (a whole tensor or a shard: a fake of its whole shape)."""
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None and not isinstance(param, FakeTensor):
                owner._parameters[name] = nn.Parameter(fake_of(param, mode), param.requires_grad)
        for name, buffer in owner._buffers.items():
            if buffer is not None and not isinstance(buffer, FakeTensor):
                owner._buffers[name] = fake_of(buffer, mode)


def _is_tensor_description(described: Any) -> bool:
    return (isinstance(described, tuple) and len(described) == 3
            and isinstance(described[1], torch.dtype))  # fmt: skip


def _stand_in_device(module: nn.Module, leaves: list[Any]) -> torch.device | None:
    """Where the placeholders of `module` go when it still lies on the meta device (a module
    of another process's stage, never given memory here) and is called with this stage's
    tensors: on their device, as the values that stage sends would be; else None."""
    tensors = [*module.parameters(), *module.buffers()]
    if not any(t.is_meta for t in tensors):
        return None
    devices = [leaf.device for leaf in leaves if isinstance(leaf, Tensor) and not leaf.is_meta]
    return devices[0] if devices else None


def _real(leaf: Any) -> bool:
    return isinstance(leaf, Tensor) and not isinstance(leaf, FakeTensor)


class _StageView:
    """A stage's view of the atoms' calls (and, where its plan names glue ops, of those) during
    one forward of the model: what it takes for other stages and what it puts in."""

    def __init__(self, cell: StageCell, received: dict[str, Tensor | None]) -> None:
        self.cell = cell
        self.plan = cell.plan
        self.stage = cell.stage
        self.sites = cell.sites
        self.last_needed = cell.plan.last_needed[cell.stage]
        self.received = received
        self.captured: dict[str, Tensor | None] = {}
        self.next = 0
        self.depth = 0  # > 0 inside an atom's call: its own torch calls are not glue

    def __call__(
        self, module: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        plan, i = self.plan, self.next
        if i >= len(plan.calls) or self.cell.atom_modules[i] is not module:
            expected = plan.calls[i].fqn if i < len(plan.calls) else "no more modules"
            raise RuntimeError(
                f"gpipe_fast.pipeline: the model's forward called {self.cell.name_of(module)!r} "
                f"where its plan has {expected!r} (call {i}): its control flow depends on the "
                "input's values, which each stage does not have"
            )
        self.next += 1
        self.depth += 1
        try:
            out = self._call(i, module, forward, args, kwargs)
        finally:
            self.depth -= 1
        if i >= self.last_needed:
            raise _StageDone
        return out

    def _call(
        self, i: int, module: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        call = self.plan.calls[i]
        leaves, spec = pytree.tree_flatten((args, kwargs))
        self._take(self.sites.capture["arg"].get(i), leaves, call.fqn)
        if call.stage == self.stage:
            self._put(self.sites.put["arg"].get(i), leaves)
            for j, leaf in enumerate(leaves):
                if isinstance(leaf, Tensor):
                    self._real(leaf, f"argument {j} of {call.fqn!r}")
            args, kwargs = pytree.tree_unflatten(leaves, spec)
            out = forward(*args, **kwargs)
        elif i < self.last_needed:
            out = self.cell.placeholders.output(i, module, forward, leaves, spec)
        else:
            return None
        return self.after(self.sites.capture["out"].get(i), self.sites.put["out"].get(i), out,
                          f"the output of {call.fqn!r}")  # fmt: skip

    def after(self, take: dict[int, str] | None, put: dict[int, str] | None, out: Any,
              what: str) -> Any:  # fmt: skip
        """`out` (an atom's or a glue op's) with this stage's sites there applied."""
        if not take and not put:
            return out
        leaves, spec = pytree.tree_flatten(out)
        self._take(take, leaves, what)
        self._put(put, leaves)
        return pytree.tree_unflatten(leaves, spec)

    def _take(self, take: dict[int, str] | None, leaves: list[Any], what: str) -> None:
        for j, key in (take or {}).items():
            self.captured[key] = self._real(leaves[j], what)

    def _put(self, put: dict[int, str] | None, leaves: list[Any]) -> None:
        for j, key in (put or {}).items():
            leaves[j] = self.received[key]

    def _real(self, leaf: Any, what: str) -> Tensor:
        if isinstance(leaf, FakeTensor):
            raise RuntimeError(
                f"gpipe_fast.pipeline: {what} holds a value that another stage computes and "
                "that the plan did not route here (the model's forward took another path than "
                "on the example inputs?)"
            )
        return leaf  # type: ignore[no-any-return]


class _GlueOps(TorchFunctionMode):
    """Counts the glue's torch calls as the planner did (not those inside atoms) and applies
    the stage's sites at the glue ops its plan names."""

    def __init__(self, view: _StageView) -> None:
        super().__init__()
        self.view = view
        self.ops = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        view = self.view
        if view.depth:
            return out
        op = self.ops
        self.ops += 1
        sites = view.sites
        take, put = sites.capture["op"].get(op), sites.put["op"].get(op)
        if take or put:
            view.depth += 1  # flattening the output makes torch calls of its own
            try:
                name = getattr(func, "__name__", func)
                out = view.after(take, put, out, f"glue op {op} ({name})")
            finally:
                view.depth -= 1
        return out


class StageCell(nn.Module):
    """Stage `stage` of `model` cut by `plan`: the layer of one cell (made skippable per stage
    by stage_cells). Its submodules are the stage's atoms at their places in the model (so its
    parameters keep the model's names); the model itself is held but not registered."""

    def __init__(self, model: nn.Module, plan: Plan, stage: int, extra: list[str]) -> None:
        super().__init__()
        self.plan = plan
        self.stage = stage
        self.last = stage == plan.stages - 1
        self.present = list(plan.tensor_inputs)  # stage 0: the inputs of the current step
        # The last stage: keywords of the model's forward set for a step (its loss's count,
        # num_items_in_batch), over any given as inputs.
        self.loss_kwargs: dict[str, Any] = {}
        self.__dict__["_model"] = model  # not a submodule: each cell holds only its atoms
        self._model: nn.Module
        for fqn in [*plan.atoms[stage], *extra]:
            _place(self, fqn, model.get_submodule(fqn))
        self.atom_modules = [model.get_submodule(call.fqn) for call in plan.calls]
        install(self.atom_modules)
        self.placeholders = _Placeholders(model)
        self.sites = plan.sites(stage)
        consumed = plan.consumed_by(stage)
        # From the stage just before: the boundary value; from further back: skips.
        self.pops = sorted((r.key, _skip_name(r.key, stage)) for r in consumed
                           if r.producer != stage - 1)  # fmt: skip
        self.stashes = sorted((r.key, _skip_name(r.key, t)) for r in plan.produced_by(stage)
                              for t in r.consumers if t > stage + 1)  # fmt: skip
        self.passes = sorted(r.key for r in plan.produced_by(stage) if stage + 1 in r.consumers)

    def name_of(self, module: nn.Module) -> str:
        for name, found in self._model.named_modules():
            if found is module:
                return name or "the model"
        return type(module).__name__

    def forward(self, value: Any):  # type: ignore[no-untyped-def]
        plan = self.plan
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
        args, kwargs = _inputs(plan, received)
        if self.last and self.loss_kwargs:
            kwargs.update(self.loss_kwargs)
        view = _StageView(self, received)
        output = None
        with viewing(view), _GlueOps(view) if self.sites.any_ops() else nullcontext():
            try:
                output = self._model(*args, **kwargs)
            except _StageDone:
                pass
        captured = view.captured
        if self.stage == 0:
            captured.update((plan.input_key(n), received[plan.input_key(n)])
                            for n in plan.tensor_inputs)  # fmt: skip
        output = view.after(self.sites.capture["end"].get(-1), self.sites.put["end"].get(-1),
                            output, "the model's output")  # fmt: skip
        for key, name in self.stashes:
            yield stash(name, captured[key])
        if self.last:
            return _checked_output(output)
        return {key: captured[key] for key in self.passes}


def _skip_name(key: str, consumer: int) -> str:
    return f"{key}>{consumer}"


def _inputs(plan: Plan, received: dict[str, Tensor | None]) -> tuple[list[Any], dict[str, Any]]:
    values = dict(plan.constant_inputs)
    values.update((n, received[plan.input_key(n)]) for n in plan.tensor_inputs)
    args = [values.pop(str(i)) for i in range(plan.positional)]
    return args, values


def _checked_output(output: Any) -> Any:
    for j, leaf in enumerate(pytree.tree_leaves(output)):
        if isinstance(leaf, FakeTensor):
            raise RuntimeError(f"gpipe_fast.pipeline: the model's output leaf {j} was not routed")
    return output


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


def stage_cells(model: nn.Module, plan: Plan) -> list[nn.Module]:
    """The model's stages as cells (each a class of its own, declaring its skips); modules
    that the forward never calls go with stage 0, so that nothing of the model is lost."""
    extra = _uncovered(model, {fqn for names in plan.atoms for fqn in names})
    cells: list[nn.Module] = []
    for k in range(plan.stages):
        consumed = [r for r in plan.consumed_by(k) if r.producer != k - 1]
        produced = [(r, t) for r in plan.produced_by(k) for t in r.consumers if t > k + 1]
        cls = skippable(
            stash=[_skip_name(r.key, t) for r, t in produced],
            pop=[_skip_name(r.key, k) for r in consumed],
        )(StageCell)
        cells.append(cls(model, plan, k, extra if k == 0 else []))
    return cells


def _uncovered(model: nn.Module, atoms: set[str]) -> list[str]:
    """The outermost modules holding, under a name of their own, parameters or buffers that no
    atom holds under that name (a module the forward never calls; `shared`, whose weight an
    atom holds under another name): stage 0 keeps them, so every key of the model stays."""
    found: list[str] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if not name or any(name == a or name.startswith(a + ".") for a in [*atoms, *found]):
            continue
        if module._parameters or module._buffers:
            found.append(name)
    return found

"""One forward of the model on one stage: atoms dispatched, values taken and put, checked.

The values it sends are taken where its run makes them, and those it receives are put where
its run makes its placeholders of them, each matched by identity (capture/identity.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from gpipe_fast.capture.identity import Key, KeyedRun, rebuilt, replace
from gpipe_fast.capture.placeholders import Placeholders
from gpipe_fast.capture.places import tensor_at
from gpipe_fast.capture.plan import CapturePlan


@dataclass(frozen=True)
class Sites:
    """What one stage takes and puts under one plan (value key -> route key), found once."""

    takes: dict[int, str]
    puts: dict[int, str]
    wanted: int  # how many routes it takes for others
    own_calls: int  # how many of its calls are its own atoms'
    out_calls: frozenset[int]  # the calls whose outputs it takes or puts
    glue_ops: bool  # whether it takes or puts a value a glue op makes (it keys the glue then)

    @classmethod
    def of(cls, plan: CapturePlan, stage: int) -> Sites:
        takes, puts = plan.takes(stage), plan.puts(stage)
        values = [plan.values[k] for k in (*takes, *puts)]
        return cls(
            takes, puts, len(set(takes.values())), plan.own_calls(stage),
            frozenset(v.call for v in values if v.kind == "out"),
            any(v.kind == "op" for v in values),
        )  # fmt: skip


class Cell(Protocol):
    """What a run needs of its stage's cell (capture/cell.py's CapturedCell)."""

    stage: int
    last: bool
    _model: nn.Module
    placeholders: Placeholders

    def sites(self, plan: CapturePlan) -> Sites: ...
    def atom_modules(self, plan: CapturePlan) -> list[nn.Module]: ...
    def atom_ids(self, plan: CapturePlan) -> frozenset[int]: ...
    def substitutes(self, plan: CapturePlan) -> dict[int, Tensor]: ...
    def side_calls(self, plan: CapturePlan) -> set[int]: ...
    def name_of(self, module: nn.Module) -> str: ...


class StageDone(BaseException):
    """Raised through the model's forward once a stage has done all it must (a BaseException,
    so that the model's own `except Exception` lets it through)."""


class StageRun(KeyedRun):
    """One forward of the model on one stage: its atom calls and, when its plan takes or puts
    values that glue ops make, its glue ops, keyed."""

    def __init__(self, cell: Cell, plan: CapturePlan, received: dict[str, Tensor | None],
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
            found = tensor_at(model, name)
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
        first: dict[int, Tensor] = {}  # a tensor at several places: keyed by its first, as planned
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor) and id(leaf) in first:
                new = first[id(leaf)]
                if new is not leaf:
                    leaves[j], changed = new, True
                continue
            passed = id(leaf) in given or (self.glue and self.keys.made_by(leaf, start))
            if isinstance(leaf, Tensor) and not passed:
                key = self.keys.intern(("out", i, j))
                if self.glue:
                    self.keys.set(leaf, key)
                new = self._sites(key, leaf)
                first[id(leaf)] = new
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
            raise StageDone

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


def _check_real(tree: Any, what: str, stage: int) -> None:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, FakeTensor):
            raise RuntimeError(
                f"gpipe_fast.pipeline: on stage {stage}, {what} holds a value that another "
                "stage computes and that the plan did not route here (the model's forward "
                "took another path than on the example inputs?)"
            )

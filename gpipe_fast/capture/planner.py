"""The planner's run of the forward: every value keyed, what each derives from recorded.

Atoms run (on fake tensors) through the dispatch a stage uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor, nn

from gpipe_fast.capture.identity import Identities, Key, KeyedRun
from gpipe_fast.capture.plan import Call, Value
from gpipe_fast.capture.routes import Needs


class Planner(KeyedRun):
    """The second run: atoms run (on fake tensors) through the dispatch stages use, every
    value keyed, and what each derives from recorded as the plan's values."""

    def __init__(
        self, model: nn.Module, atoms: list[nn.Module], stages: list[int], count: int,
        names: dict[int, str], identities: Identities,
    ) -> None:  # fmt: skip
        super().__init__(identities, add=True)
        self.atoms, self.stages, self.names = atoms, stages, names
        self._atom_ids = {id(a) for a in atoms}
        self.calls: list[Call] = []
        self.values: dict[int, Value] = {}
        self.needs = Needs([stages.index(k) if k in stages else len(stages) for k in range(count)])
        self.stale: set[int] = set()  # values an in-place op wrote over afterwards
        self.side_calls: set[int] = set()  # atom calls whose inner modules' outputs are read
        self.inside_call: int | None = None
        self._sub_calls: dict[str, int] = {}
        self._call_start = 0  # the count of keys given when the atom call now running began
        self._state: dict[int, str] = {}
        for name, tensor in [*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)]:  # fmt: skip
            self._state.setdefault(id(tensor), name)
        for atom in {id(a): a for a in atoms}.values():
            for sub in atom.modules():
                if sub is not atom:
                    sub.register_forward_hook(self._sub_output)
        self.state_seen: set[str] = set()

    def dispatches(self, module: nn.Module) -> bool:
        return id(module) in self._atom_ids

    def value(self, key: Key) -> Value:
        assert key is not None
        return self.values[key]

    def keyed(self, tensor: Tensor, structure: tuple[Any, ...], value: Value) -> None:
        key = self.keys.intern(structure)
        assert key is not None
        self.keys.set(tensor, key)
        value.key = key
        self.values.setdefault(key, value)

    def key_of(self, tensor: Tensor) -> int:
        """A tensor's key, a parameter or buffer's by its name, an unknown one's by its kind."""
        name = self._state.get(id(tensor))
        if name is not None and self.keys.stamp_of(tensor) < 0:
            self.state_seen.add(name)
            self.keyed(tensor, ("state", name), Value(0, "state", f"{name!r}", frozenset(),
                                                      dtype=tensor.dtype, name=name))  # fmt: skip
        key = self.keys.of(tensor)
        assert key is not None
        found = self.values.get(key)
        if found is not None and found.kind == "sub":
            self.side_calls.add(found.call)  # the glue reads it: recorded by a hook, say
        if key not in self.values:
            what = "a tensor that no module returned and no torch op of the glue made"
            self.values[key] = Value(key, "untracked", what, frozenset(), dtype=tensor.dtype)
        return key

    def inputs(self, tensors: dict[str, Tensor]) -> None:
        for name, tensor in tensors.items():
            self.keyed(tensor, ("input", name), Value(0, "input", f"input {name!r}", frozenset(),
                                                      dtype=tensor.dtype, name=name))  # fmt: skip

    def _where(self) -> str:
        if not self.calls:
            return "before the first module call"
        last = self.calls[-1]
        return f"after {last.fqn!r} (call {last.index})"

    def op(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        if not self.inside:
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, Tensor):
                    self.key_of(leaf)
        return super().op(func, args, kwargs)

    def after_op(
        self, name: str, inputs: tuple[Key, ...], out: Any, leaves: list[Tensor | None],
        made: list[tuple[int, Tensor, Key]],
    ) -> Any:  # fmt: skip
        stages = frozenset().union(*(self.value(k).stages for k in inputs))
        short = name.rsplit(".", 1)[-1]
        for j, tensor, key in made:
            assert key is not None
            if j < 0:  # written in place: what it was is gone from now on
                self.stale.add(inputs[0])  # type: ignore[arg-type]
            what = f"the {'output' if j <= 0 else f'output {j}'} of {short} {self._where()}"
            known = tuple(k for k in inputs if k is not None)
            value = Value(key, "op", what, stages, known, tensor.dtype, len(self.calls), leaf=j)
            self.values.setdefault(key, value)
        return out

    def atom(self, module: nn.Module, args: Any, kwargs: Any, call: Callable[..., Any]) -> Any:
        i = len(self.calls)
        if i >= len(self.atoms) or self.atoms[i] is not module:
            raise RuntimeError(
                "gpipe_fast.pipeline: the model's forward called its modules in another order "
                "on a second run with the same inputs (its control flow is not repeatable)"
            )
        stage = self.stages[i]
        fqn = self.names[id(module)]
        self.calls.append(Call(i, fqn, stage))
        for j, leaf in enumerate(pytree.tree_leaves((args, kwargs))):
            if isinstance(leaf, Tensor):
                self.needs.add(stage, self.key_of(leaf), f"argument {j} of {fqn!r} (call {i})")
        self.inside_call, self._sub_calls, self._call_start = i, {}, self.keys.stamp
        try:
            with self.suspended():
                output = call(*args, **kwargs)
        finally:
            self.inside_call = None
        given = {id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        seen: set[int] = set()
        for j, leaf in enumerate(pytree.tree_leaves(output)):
            # A value it got and passes on (T5's position bias, block to block) stays what
            # it was; only what the call made is its output. A tensor at several places of
            # the output (T5Gemma's last hidden state, also its decoder_hidden_states) is
            # keyed by its first.
            passed = id(leaf) in given or self.keys.made_by(leaf, self._call_start)
            if isinstance(leaf, Tensor) and not passed and id(leaf) not in seen:
                seen.add(id(leaf))
                what = f"output {j} of {fqn!r} (call {i})"
                value = Value(0, "out", what, frozenset({stage}), dtype=leaf.dtype, call=i, leaf=j)
                self.keyed(leaf, ("out", i, j), value)
        return output

    def _sub_output(self, module: nn.Module, args: Any, output: Any) -> None:
        """An output of a module inside an atom: known, in case the glue reads it later (an
        output transformers records by hooks, say)."""
        i = self.inside_call
        if i is None:
            return
        fqn = self.names.get(id(module), "")
        nth = self._sub_calls[fqn] = self._sub_calls.get(fqn, -1) + 1
        for j, leaf in enumerate(pytree.tree_leaves(output)):
            if isinstance(leaf, Tensor) and not self.keys.made_by(leaf, self._call_start):
                what = f"output {j} of {fqn!r} inside {self.calls[i].fqn!r} (call {i})"
                value = Value(0, "sub", what, frozenset({self.stages[i]}), dtype=leaf.dtype,
                              call=i, name=fqn, nth=nth, leaf=j)  # fmt: skip
                self.keyed(leaf, ("sub", i, fqn, nth, j), value)

"""Value identity: each tensor the glue makes or reads is known by what it is, never by count.

It is computed the same way in the plan and on every stage, so a value that crosses stages is
matched where it is made and where it is put. A tensor's key is interned from its structure:
a model input by name; a parameter or buffer by name; an atom's output by (call, leaf); an
output of a module inside an atom by (call, module, nth call, leaf); a glue op's output by (op,
its inputs' keys, its other arguments, how many such ops came before, leaf). Integers are left
out of an op's other arguments (they are shapes, which change with the micro-batch), and so
are devices (a stage's are not the plan's): extra ops on one side (a check that runs on real
tensors only, a `.device` read) leave every other key as it is. The planner interns new
structures; a stage only looks them up, so a value the plan never saw has no key (None), nor
has anything made from it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import (
    TorchFunctionMode,
    _get_current_function_mode_stack,
    _pop_mode,
    _push_mode,
)

Key = int | None
Structure = tuple[Any, ...]


class Identities:
    """Structures interned as small ints: the planner adds them, stages look them up."""

    def __init__(self) -> None:
        self.table: dict[Structure, int] = {}

    def intern(self, structure: Structure, add: bool) -> Key:
        found = self.table.get(structure)
        if found is None and add:
            found = self.table[structure] = len(self.table)
        return found


class Keys:
    """The keys of one forward's tensors, by object (held weakly: keying keeps nothing alive)."""

    def __init__(self, identities: Identities, add: bool) -> None:
        self.identities = identities
        self.add = add
        self._of: dict[int, tuple[weakref.ref[Tensor], Key, int]] = {}
        self._counts: dict[Structure, int] = {}
        self.stamp = 0  # counts the keys given, so that an op can tell which it did not give

    def intern(self, structure: Structure) -> Key:
        return self.identities.intern(structure, self.add)

    def of(self, tensor: Tensor) -> Key:
        found = self._of.get(id(tensor))
        if found is not None and found[0]() is tensor:
            return found[1]
        # Made where nothing keyed it (a plain tensor attribute of a module, say): known only
        # by its kind, alike wherever it is.
        return self.intern(("untracked", str(tensor.dtype), tensor.dim()))

    def stamp_of(self, tensor: Tensor) -> int:
        found = self._of.get(id(tensor))
        return found[2] if found is not None and found[0]() is tensor else -1

    def made_by(self, tensor: Tensor, stamp: int) -> bool:
        """Whether `tensor` was keyed when the count of keys given was `stamp` or less (a
        value that existed before, which a module returns as it got it)."""
        return 0 <= self.stamp_of(tensor) <= stamp

    def set(self, tensor: Tensor, key: Key) -> None:
        self.stamp += 1
        self._of[id(tensor)] = (weakref.ref(tensor), key, self.stamp)

    def nth(self, base: Structure) -> int:
        """How many times `base` came before in this forward (and count this one)."""
        n = self._counts.get(base, 0)
        self._counts[base] = n + 1
        return n


def op_name(func: Callable[..., Any]) -> str:
    """A torch function's name: `Tensor.shape`'s getter is "Tensor.shape"."""
    qualname = getattr(func, "__qualname__", None) or repr(func)
    if qualname.endswith(".__get__"):
        owner = getattr(func, "__self__", None)
        return f"Tensor.{getattr(owner, '__name__', qualname)}"
    for prefix, name in (("_VariableFunctionsClass.", "torch."), ("TensorBase.", "Tensor.")):
        if qualname.startswith(prefix):
            return name + qualname[len(prefix) :]
    module = getattr(func, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


def in_place(name: str) -> bool:
    """Whether the op writes its first argument: `add_`, `__iadd__`, `__setitem__`..."""
    short = name.rsplit(".", 1)[-1]
    if short.startswith("__"):
        return short.startswith("__i") or short == "__setitem__"
    return short.endswith("_")


def _constant(value: Any) -> Any:
    """What of an op's non-tensor argument goes into its key."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else value
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, torch.device):
        return "device"
    if isinstance(value, slice):
        return ("slice", _constant(value.start), _constant(value.stop), _constant(value.step))
    if value is Ellipsis:
        return "..."
    return type(value).__name__


def walk(value: Any, tensors: list[Tensor]) -> Any:
    """`value`'s tensors appended to `tensors`, and the structure of the rest."""
    if isinstance(value, Tensor):
        tensors.append(value)
        return "T"
    if isinstance(value, (tuple, list)):
        return tuple(walk(v, tensors) for v in value)
    if isinstance(value, dict):
        return tuple((k, walk(v, tensors)) for k, v in value.items())
    return _constant(value)


def replace(value: Any, table: dict[int, Tensor]) -> Any:
    """`value` with each tensor found in `table` (by id) replaced."""
    if isinstance(value, Tensor):
        return table.get(id(value), value)
    if isinstance(value, tuple) and not hasattr(value, "_fields") and type(value) is tuple:
        return tuple(replace(v, table) for v in value)
    if isinstance(value, list):
        return [replace(v, table) for v in value]
    if isinstance(value, dict) and type(value) is dict:
        return {k: replace(v, table) for k, v in value.items()}
    return value


def out_leaves(out: Any) -> list[Tensor | None]:
    """The tensors an op returned (one level of tuple or list), None for other items."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [item if isinstance(item, Tensor) else None for item in out]
    return []


def rebuilt(out: Any, leaves: list[Tensor | None]) -> Any:
    """`out` with its tensors replaced by `leaves` (see out_leaves)."""
    if isinstance(out, Tensor):
        return leaves[0]
    items = [new if new is not None else old for old, new in zip(out, leaves, strict=True)]
    if isinstance(out, list):
        return items
    if hasattr(out, "_fields"):  # a namedtuple
        return type(out)(*items)
    return type(out)(items) if type(out) is not tuple else tuple(items)


class GlueMode(TorchFunctionMode):
    """Hands every torch call of the forward to `run.op` (atoms suspend it: see KeyedRun)."""

    def __init__(self, run: KeyedRun) -> None:
        super().__init__()
        self.run = run

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return self.run.op(func, args, kwargs or {})


class KeyedRun:
    """One run of the model's forward whose glue ops are keyed; `after_op` is what the planner
    or a stage does with each one's outputs."""

    def __init__(self, identities: Identities, add: bool) -> None:
        self.keys = Keys(identities, add)
        self.mode: GlueMode | None = None
        self.inside = 0  # > 0 inside an atom's call: its torch calls are not glue
        self.substitutes: dict[int, Tensor] = {}  # a stage's own copies of the model's tensors

    def op(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        if self.inside:
            return func(*args, **kwargs)
        if self.substitutes:
            args, kwargs = replace(args, self.substitutes), replace(kwargs, self.substitutes)
        stamp = self.keys.stamp
        out = func(*args, **kwargs)
        leaves = out_leaves(out)
        name = op_name(func)
        writes = bool(args) and isinstance(args[0], Tensor) and in_place(name)
        if not writes and not any(leaf is not None for leaf in leaves):
            return out
        tensors: list[Tensor] = []
        constants = walk((args, kwargs), tensors)
        keys = self.keys
        inputs = tuple(keys.of(t) for t in tensors)
        op: Structure = (name, inputs, constants)
        base = (*op, keys.nth(op))
        known = None not in inputs
        given = {id(t) for t in tensors}
        made: list[tuple[int, Tensor, Key]] = []
        if writes:  # the tensor written holds another value from now on
            key = keys.intern(("op", *base, "self")) if known else None
            keys.set(tensors[0], key)
            made.append((-1, tensors[0], key))
        for j, leaf in enumerate(leaves):
            if leaf is None or keys.stamp_of(leaf) > stamp:
                continue  # not a tensor, or keyed inside the op (an atom called by it)
            if id(leaf) in given:
                if writes and leaf is tensors[0]:
                    made.append((j, leaf, made[0][2]))
                continue  # an input passed through (dropout in evaluation): the same value
            key = keys.intern(("op", *base, j)) if known else None
            keys.set(leaf, key)
            made.append((j, leaf, key))
        if not made:
            return out
        return self.after_op(name, inputs, out, leaves, made)

    def after_op(
        self, name: str, inputs: tuple[Key, ...], out: Any, leaves: list[Tensor | None],
        made: list[tuple[int, Tensor, Key]],
    ) -> Any:  # fmt: skip
        """What the run does with a glue op's new values: (leaf, tensor, key) each (leaf -1:
        the tensor an in-place op wrote). Returns the op's output (possibly replaced)."""
        return out

    def enter(self) -> GlueMode:
        self.mode = GlueMode(self)
        return self.mode

    def suspended(self) -> _Suspended:
        """The glue mode off meanwhile (inside an atom): its ops are not glue."""
        return _Suspended(self)


class _Suspended:
    __slots__ = ("popped", "run")

    def __init__(self, run: KeyedRun) -> None:
        self.run = run
        self.popped = False

    def __enter__(self) -> None:
        mode = self.run.mode
        stack = _get_current_function_mode_stack() if mode is not None else []
        if stack and stack[-1] is mode:
            _pop_mode()
            self.popped = True
        else:  # another mode above it (or none): counted instead
            self.run.inside += 1

    def __exit__(self, *_: object) -> None:
        if self.popped:
            _push_mode(self.run.mode)
        else:
            self.run.inside -= 1

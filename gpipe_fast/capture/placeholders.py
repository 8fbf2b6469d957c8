"""Placeholders of other stages' atoms on a stage: fake outputs of the shapes they would have."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from gpipe_fast.capture.copies import ShapeRules, fake_memo, fake_of, quiet, shapes_only


def describe(leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device)
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return leaf
    return type(leaf).__qualname__


def is_real(leaf: Any) -> bool:
    return isinstance(leaf, Tensor) and not isinstance(leaf, FakeTensor)


class Placeholders:
    """Fake outputs of other stages' atoms, per call, mode and argument shapes: the atom runs
    once on fake tensors for each new shape, then its output's shapes are reused. It runs as
    a shadow: a quiet copy of the module (capture/copies.py: no hook of the user's fires)
    whose parameters and buffers (the whole model's, wherever the copy reaches them) are
    fake, so that what its forward writes (a BatchNorm's statistics, any attribute) stays in
    the copy. The module itself belongs to its own stage, which may be running it for real
    at that moment on another thread."""

    def __init__(self, model: nn.Module) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._model = model
        self._memo: dict[int, Any] | None = None  # deepcopy's memo: real tensor id -> fake
        self._shadows: dict[int, nn.Module] = {}
        self._outputs: dict[Any, tuple[list[Any], Any]] = {}
        # Called with (call, fqn in the model, shadow module) when a shadow is made, to hook
        # the modules whose outputs this stage receives from inside that call.
        self.on_shadow: Callable[[str, nn.Module], None] | None = None

    def shadow(self, module: nn.Module, fqn: str) -> nn.Module:
        shadow = self._shadows.get(id(module))
        if shadow is None:
            if self._memo is None:
                self._memo = fake_memo(self._model, self.mode)
            # The module's tensors as they are now: a sharded stage's FSDP swaps its modules'
            # parameters between shards and whole tensors as it runs, on its own thread.
            self._memo.update(fake_memo(module, self.mode))
            shadow = copy.deepcopy(module, self._memo)
            _all_fake(shadow, self.mode)
            quiet(shadow)
            if self.on_shadow is not None:
                self.on_shadow(fqn, shadow)
            self._shadows[id(module)] = shadow
        return shadow

    def output(
        self, call: int, fqn: str, module: nn.Module, args: Any, kwargs: Any, training: bool,
        fresh: bool = False,
    ) -> Any:  # fmt: skip
        """The placeholder of `module`'s call `call` on these arguments; `fresh`: its shadow
        runs again (its hooks record what the glue reads of it)."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = (training, call, tuple(describe(leaf) for leaf in leaves))
        found = None if fresh else self._outputs.get(key)
        if found is None:
            stand_in = _stand_in_device(module, leaves)
            shadow = self.shadow(module, fqn)
            if shadow.training != training:
                shadow.train(training)
            if stand_in is None:
                # Real arguments stay real (copies: the copy may write them): what it computes
                # from them alone (a mask from the inputs) it computes for real, as its own
                # stage does; the rest is fake.
                copies = [t.detach().clone() if is_real(t) else t for t in leaves]
                copied_args, copied_kwargs = pytree.tree_unflatten(copies, spec)
                with ShapeRules(), torch.no_grad():
                    out = shadow(*copied_args, **copied_kwargs)
            else:  # all on meta, as the module's own tensors are
                with shapes_only(self.mode):
                    fakes = [self.mode.from_tensor(t) if is_real(t) else t for t in leaves]
                    fakes = [t.to("meta") if isinstance(t, Tensor) else t for t in fakes]
                    fake_args, fake_kwargs = pytree.tree_unflatten(fakes, spec)
                    out = shadow(*fake_args, **fake_kwargs)
            out_leaves, out_spec = pytree.tree_flatten(out)
            # An input the module passes on is that input again (its leaf's index), as it is
            # where the module runs for real.
            passed = {id(t): i for i, t in enumerate(copies if stand_in is None else fakes)
                      if isinstance(t, Tensor)}  # fmt: skip
            # A tensor at several places of the output is one tensor there too ("same").
            first: dict[int, int] = {}
            for j, leaf in enumerate(out_leaves):
                if isinstance(leaf, Tensor):
                    first.setdefault(id(leaf), j)
            described = [
                ("input", passed[id(leaf)]) if id(leaf) in passed
                else ("same", first[id(leaf)]) if isinstance(leaf, Tensor) and first[id(leaf)] < j
                else describe(leaf) if isinstance(leaf, Tensor) else leaf
                for j, leaf in enumerate(out_leaves)
            ]  # fmt: skip
            if stand_in is not None:  # what the glue would get from that stage: on this one's
                described = [(d[0], d[1], stand_in) if _is_tensor_description(d) else d
                             for d in described]  # fmt: skip
            found = self._outputs[key] = (described, out_spec)
        described, out_spec = found
        made: list[Any] = []
        with self.mode:
            for d in described:
                made.append(
                    torch.empty(d[0], dtype=d[1], device=d[2]) if _is_tensor_description(d)
                    else leaves[d[1]] if _is_passed(d)
                    else made[d[1]] if _is_same(d) else d
                )  # fmt: skip
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


def _is_passed(described: Any) -> bool:
    return isinstance(described, tuple) and len(described) == 2 and described[0] == "input"


def _is_same(described: Any) -> bool:
    return isinstance(described, tuple) and len(described) == 2 and described[0] == "same"


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

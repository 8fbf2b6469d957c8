"""Fake copies of a model's modules for the planner and the placeholders, quiet (no user hook)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpipe_fast.nn.compiled import uncompile
from gpipe_fast.nn.dtensors import is_dtensor

# A module's hooks, by the attribute holding them; the with_kwargs and always_called sets
# name hooks of the first two by their handle's id.
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_HOOK_SETS = (
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
)  # fmt: skip


def fake_memo(model: nn.Module, mode: FakeTensorMode) -> dict[int, Any]:
    """A deepcopy memo that copies each of the model's parameters, buffers and tensors kept
    as attributes as `mode`'s fake tensor (a module copied with it computes shapes alone, and
    writes only to itself), and each module's hooks as the model's own alone (the user's do
    not reach the copy: a hook's state is not copied, and it never fires on a copy)."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None and id(tensor) not in memo:
                memo[id(tensor)] = fake_of(tensor, mode)
        for value in list(module.__dict__.values()):
            if isinstance(value, Tensor) and id(value) not in memo:
                memo[id(value)] = fake_of(value, mode)
        for attribute in _HOOKS:
            hooks = module.__dict__.get(attribute)
            if hooks is not None:
                memo[id(hooks)] = OrderedDict((k, h) for k, h in hooks.items() if model_hook(h))
    return memo


def fake_of(tensor: Tensor, mode: FakeTensorMode) -> Tensor:
    """`tensor` as a new fake tensor of `mode`, of its shape, strides, dtype and device (a shard,
    a DTensor of a sharded stage: of its whole tensor's shape, which the model's code computes
    with). Made anew rather than converted, so that nothing else refers to it: a forward that
    casts its own module (`self.classifier.to(torch.float32)`, as Switch Transformers' router
    does) swaps the fake's contents, which torch allows only then."""
    with mode:
        if is_dtensor(tensor):
            fake = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        else:
            fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                       device=tensor.device)  # fmt: skip
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(fake, tensor.requires_grad)
    return fake.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else fake


def planning_copy(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """A copy of `model` whose parameters and buffers are `mode`'s fake tensors, to run its
    forward for shapes: what the forward writes (a BatchNorm's count of batches, any
    attribute) lands in the copy, never in the model, and no hook of the user's fires. The
    copy has the model's names."""
    try:
        planned = copy.deepcopy(model, fake_memo(model, mode))
    except Exception as error:
        raise TypeError(
            f"gpipe_fast.pipeline plans on a copy of the model (so that running its forward "
            f"changes nothing in it), and copy.deepcopy failed on it: {error}"
        ) from error
    quiet(planned)
    return planned


def model_hook(hook: Any) -> bool:
    """Whether a hook is the model's own: transformers records the outputs its forward returns
    (`output_router_logits`, `output_hidden_states`) by hooks on its layers."""
    return str(getattr(hook, "__module__", "")).startswith("transformers.")


def quiet(module: nn.Module) -> None:
    """A copy made quiet: none of the user's hooks fires on it (the model's own stay), nor any
    hook registered for every module, and its TransformerEncoders do not take the
    nested-tensor fast path (fake tensors cannot be nested; the output's shape is the same)."""
    uncompile(module)  # shapes need no compiled code (nor a copy running the original)
    for owner in module.modules():
        for attribute in _HOOKS:
            hooks = getattr(owner, attribute, None)
            if hooks:
                kept = OrderedDict((k, h) for k, h in hooks.items() if model_hook(h))
                setattr(owner, attribute, kept)
        for attribute in _HOOK_SETS:
            ids = getattr(owner, attribute, None)
            if ids:
                live = {*owner._forward_hooks, *owner._forward_pre_hooks}
                setattr(owner, attribute, {k: v for k, v in ids.items() if k in live})
        owner._compiled_call_impl = _OwnCall(owner)
        if isinstance(owner, nn.TransformerEncoder):
            owner.use_nested_tensor = False


class _OwnCall:
    """A copy's module called (as its `_compiled_call_impl`, which `module(...)` calls first):
    its forward between its own hooks, which quiet() left to the model's, and none of those
    registered for every module (`register_module_forward_hook`: the user's, which would see
    fake tensors)."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        for key, hook in list(module._forward_pre_hooks.items()):
            if key in module._forward_pre_hooks_with_kwargs:
                changed = hook(module, args, kwargs)
                if changed is not None:
                    args, kwargs = changed
            else:
                changed = hook(module, args)
                if changed is not None:
                    args = changed if isinstance(changed, tuple) else (changed,)
        output = module.forward(*args, **kwargs)
        for key, hook in list(module._forward_hooks.items()):
            if key in module._forward_hooks_with_kwargs:
                changed = hook(module, args, kwargs, output)
            else:
                changed = hook(module, args, output)
            if changed is not None:
                output = changed
        return output


class ShapeRules(TorchDispatchMode):
    """Output shapes where torch's fake kernel refuses what its real one computes:
    `_grouped_mm` (transformers' default experts kernel) is fake in bf16 only, and runs on
    the CPU in float32 too."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket is not torch.ops.aten._grouped_mm:
            return func(*args, **kwargs)
        fake = any(isinstance(t, FakeTensor) for t in args)
        if fake and args[0].dtype != torch.bfloat16:  # torch's fake kernel would refuse it
            return _grouped_mm_output(*args, **kwargs)
        return func(*args, **kwargs)


def _grouped_mm_output(
    mat_a: Tensor, mat_b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:  # fmt: skip
    """The shape of `torch._grouped_mm`'s output: 2-d x 3-d (groups along the rows) is
    (M, N); 3-d x 3-d a batched matmul; 2-d x 2-d (groups along K) is (G, M, N)."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        assert offs is not None
        shape = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:
        shape = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        shape = [mat_a.size(1), mat_b.size(1)]
    else:
        shape = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    fake = next((t for t in (mat_a, mat_b) if isinstance(t, FakeTensor)), None)
    with fake.fake_mode if fake is not None else nullcontext():
        return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


@contextmanager
def shapes_only(mode: FakeTensorMode) -> Iterator[None]:
    """Runs in `mode` (fake tensors), with the shape rules above, without gradients."""
    with mode, ShapeRules(), torch.no_grad():
        yield

"""The autograd engine as a stage calls it: backward and grad, a layer's whole backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def _engine_backward(roots: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """torch.autograd.backward straight into the engine: the public call checks its
    arguments (~20 us a call: a symbolic shape comparison per root) and the private wrapper
    adds a few more; here roots and gradients come from the pipe itself and match by
    construction. Falls back to the public call if torch moves the entry point."""
    _run_engine(tuple(roots), tuple(grads), False, False, (), True, True)


def _public_backward(roots: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    torch.autograd.backward(list(roots), list(grads))


def _engine_grad(
    roots: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor], retain: bool
) -> tuple[Tensor | None, ...]:
    """torch.autograd.grad(allow_unused=True) straight into the engine, as above."""
    return _run_engine(tuple(roots), tuple(grads), retain, False, tuple(inputs), True, False)


def _public_grad(
    roots: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor], retain: bool
) -> tuple[Tensor | None, ...]:
    return torch.autograd.grad(roots, inputs, grads, retain_graph=retain, allow_unused=True)


try:
    _run_engine = torch.autograd.Variable._execution_engine.run_backward
except AttributeError:  # pragma: no cover - a torch without the engine handle
    run_backward, run_grad = _public_backward, _public_grad
else:
    run_backward, run_grad = _engine_backward, _engine_grad


def aligned(
    tensors: Sequence[Tensor], wanted: Sequence[Tensor], got: Sequence[Any]
) -> tuple[Any, ...]:
    """Per tensor of `tensors`, its gradient from `got` (computed for `wanted`, the tensors
    among them that require a gradient), or None."""
    by_id = {id(t): g for t, g in zip(wanted, got, strict=True)}
    return tuple(by_id.get(id(t)) for t in tensors)


def grad_of(tensor: Tensor | None) -> Tensor | None:
    """The gradient accumulated on a leaf, None when it has none or needs none."""
    return tensor.grad if tensor is not None and tensor.requires_grad else None


def with_graph(roots: list[Tensor], grads: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """The roots with a graph behind them, and their gradients: a leaf root (a stashed
    input of a layer) leads to no weight."""
    pairs = [(r, g) for r, g in zip(roots, grads, strict=True) if r.grad_fn is not None]
    return [r for r, _ in pairs], [g for _, g in pairs]


def whole_backward(
    roots: list[Tensor],
    grads: list[Tensor],
    inputs: tuple[Tensor, ...],
    wanted: list[Tensor],
    params: list[Tensor],
) -> tuple[Tensor | None, ...]:
    """One layer's whole backward: its weights' gradients accumulated, its inputs' returned
    (per input, None where it needs none)."""
    if not roots:
        return (None,) * len(inputs)
    torch.autograd.backward(roots, grads, inputs=[*wanted, *params])
    found = tuple(t.grad if t.requires_grad else None for t in inputs)
    for tensor in wanted:  # the layer's input leaves: their gradient goes on, not kept
        tensor.grad = None
    return found

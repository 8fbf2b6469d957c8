"""Splits a mini-batch into micro-batches along dim 0 and joins the results back."""

from __future__ import annotations

import torch
from torch import Tensor

# A value flowing between cells: what the user passes and what cells return.
Value = Tensor | tuple[Tensor, ...]


def as_tensors(value: object, what: str) -> tuple[Tensor, ...]:
    """The tensors of a Value; TypeError naming `what` for anything else."""
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, tuple) and value and all(isinstance(t, Tensor) for t in value):
        return value
    raise TypeError(
        f"{what} must be a Tensor or a non-empty tuple of Tensors, got {_describe(value)}"
    )


def like(tensors: tuple[Tensor, ...] | list[Tensor], template: Value) -> Value:
    """Packs tensors back into the shape of `template` (a lone Tensor or a tuple)."""
    return tuple(tensors) if isinstance(template, tuple) else tensors[0]


def batch_size(tensors: tuple[Tensor, ...], what: str) -> int:
    """The common size of dim 0; ValueError naming `what` when they differ or are scalars."""
    sizes = set()
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise ValueError(f"{what}[{i}] is a scalar tensor; every tensor needs a batch dim 0")
        sizes.add(t.size(0))
    if len(sizes) != 1:
        raise ValueError(f"{what} tensors have different batch sizes (dim 0): {sorted(sizes)}")
    return sizes.pop()


def split_sizes(n: int, chunks: int) -> list[int]:
    """Near-equal micro-batch sizes for n samples: min(chunks, n) parts, none empty."""
    parts = min(chunks, n)
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def scatter(value: Value, chunks: int) -> list[Value]:
    """Splits every tensor of `value` along dim 0 into near-equal micro-batches."""
    tensors = as_tensors(value, "input")
    n = batch_size(tensors, "input")
    if n == 0:
        raise ValueError("input has an empty batch (dim 0 is 0)")
    sizes = split_sizes(n, chunks)
    pieces = [t.split(sizes) for t in tensors]
    return [like([p[m] for p in pieces], value) for m in range(len(sizes))]


def gather(values: list[Value]) -> Value:
    """Concatenates micro-batch results along dim 0 (no copy for a single micro-batch)."""
    if len(values) == 1:
        return values[0]
    columns = zip(*(as_tensors(v, "output") for v in values), strict=True)
    return like([torch.cat(column) for column in columns], values[0])


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return "tuple(" + ", ".join(type(v).__name__ for v in value) + ")"
    return type(value).__name__

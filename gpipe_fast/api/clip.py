"""Gradient clipping by the whole model's norm, however its cells are spread over ranks."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import Tensor, nn

from gpipe_fast.nn.dtensors import is_dtensor
from gpipe_fast.nn.tied import local_part

# Sums (or, for the inf-norm, takes the max of) a tensor over the ranks that hold the other
# cells of the model, in place; None in one process.
Reduce = Callable[[Tensor, str], None]


def check_clip_arguments(max_norm: object, norm_type: object) -> tuple[float, float]:
    """(max_norm, norm_type) as floats, or ValueError/TypeError naming the bad argument."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"max_norm must be a number, got {max_norm!r}")
    if not max_norm > 0 or math.isnan(max_norm):
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    if isinstance(norm_type, str) and norm_type.lower() == "inf":
        norm_type = math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise ValueError(f"norm_type must be a number > 0 or 'inf', got {norm_type!r}")
    if not norm_type > 0 or math.isnan(norm_type):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    return float(max_norm), float(norm_type)


# The dtypes a gradient norm can have (torch's norms of real and complex gradients): each
# rank marks the ones its counted gradients' norm has, in the same all-reduce as its share.
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
    *,
    counted_elsewhere: set[int],
    reduce: Reduce | None,
    device: torch.device,
) -> Tensor:
    """Clips the gradients of `parameters` (this rank's, each once) by the norm of every
    gradient of the model, and returns that norm, bitwise the same tensor on every rank.

    A tensor whose id is in `counted_elsewhere` (a tied weight's copy that another rank
    counts) is clipped but left out of this rank's share of the norm; `reduce` combines the
    shares of the ranks: the p-th powers summed, or the maxima for the inf-norm, so the cost
    is one all-reduce of a few numbers. The norm's dtype is the one torch gives the whole
    model's: every rank's counted gradients' dtypes promoted together (the default dtype
    when no rank counts any), agreed in that all-reduce, so that a rank counting nothing
    (all its parameters are tied copies counted elsewhere) clips by the same factor as the
    others and the tied copies stay equal."""
    with_grad = [p for p in parameters if p.grad is not None]
    # A sharded stage's gradient is a DTensor: its norm share is its own shard's, the shards
    # of the other replicas are counted there (`reduce` sums over them too).
    grads = [local_part(cast(Tensor, p.grad)) for p in with_grad]
    counted = [g for p, g in zip(with_grad, grads, strict=True) if id(p) not in counted_elsewhere]
    local = torch.nn.utils.get_total_norm(counted, norm_type, False, foreach)
    # [share, one mark per dtype in NORM_DTYPES]: a sum (or max) > 0 means some rank has it.
    shares = torch.zeros(1 + len(NORM_DTYPES), dtype=torch.float64, device=device)
    shares[0] = local.to(device=device, dtype=torch.float64)
    if counted:
        shares[1 + _dtype_index(local.dtype)] = 1.0
    if reduce is not None:
        if math.isinf(norm_type):
            reduce(shares, "max")
        else:
            shares[0] = shares[0].pow(norm_type)
            reduce(shares, "sum")
            shares[0] = shares[0].pow(1.0 / norm_type)
    total = shares[0].to(_agreed_dtype(shares[1:].tolist()))
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the pipe's gradients is non-finite, so "
            "it cannot be clipped (error_if_nonfinite=True); every rank raises alike"
        )
    if any(is_dtensor(p.grad) for p in with_grad):
        # Each shard scaled in place, by the factor torch's clip_grads_with_norm_ uses.
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for grad in grads:
                grad.mul_(factor.to(grad.device))
    else:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach)
    return total


def _dtype_index(dtype: torch.dtype) -> int:
    if dtype not in NORM_DTYPES:
        raise TypeError(
            f"pipe.clip_grad_norm_ supports gradients whose norm is one of {NORM_DTYPES}, "
            f"got a norm of dtype {dtype}"
        )
    return NORM_DTYPES.index(dtype)


def _agreed_dtype(marks: list[float]) -> torch.dtype:
    """The promotion of the dtypes some rank marked, as torch stacks the norms of gradients
    of several dtypes; torch's default dtype when none did (torch's norm of no gradient)."""
    present = [dtype for dtype, mark in zip(NORM_DTYPES, marks, strict=True) if mark > 0]
    if not present:
        return torch.get_default_dtype()
    agreed = present[0]
    for dtype in present[1:]:
        agreed = torch.promote_types(agreed, dtype)
    return agreed

"""Chooses a balance (layers per cell) from per-layer costs: parameters, time, size, or yours."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from gpipe_fast import _C
from gpipe_fast.arguments import check_cost, check_costs, check_count, check_int, check_module
from gpipe_fast.balancing.profile import (
    Device,
    Sample,
    layer_costs_by_params,
    layer_costs_by_size,
    layer_costs_by_time,
)


def partition(costs: Sequence[float], k: int) -> list[int]:
    """Layers per cell of the contiguous split of `costs` into `k` non-empty cells whose largest
    cell cost is the smallest possible; among such splits, the most even one (least sum of
    squared cell costs). Exact, by the native dynamic program in gpipe_fast._C."""
    checked = check_costs(costs, "costs")
    cells = check_count(k, "k", len(checked))
    return list(_C.partition(checked, cells))


def balance_by_params(partitions: int, module: nn.Sequential) -> list[int]:
    """A balance evening out parameter counts (see layer_costs_by_params); needs no sample."""
    module = check_module(module)
    cells = check_count(partitions, "partitions", len(module))
    return partition(layer_costs_by_params(module), cells)


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: Sample,
    *,
    device: Device | None = None,
    warmup: int = 2,
    repeats: int | None = None,
    timeout: float | None = None,
    cost: str = "total",
) -> list[int]:
    """A balance evening out measured time per cell. `sample` is a representative input batch;
    `cost` picks what to even out: "total" (forward + backward, for training), "forward" (for
    inference) or "backward". Each layer is measured `repeats` times (default 5), or for its
    share of `timeout` seconds (torchgpipe's keyword; see profile_layers). The module is left
    as it was, parameters' ``.grad`` included; `device` defaults to the module's own."""
    module = check_module(module)
    cells = check_count(partitions, "partitions", len(module))
    costs = layer_costs_by_time(
        module,
        sample,
        device=device,
        warmup=warmup,
        repeats=repeats,
        timeout=timeout,
        cost=cost,
    )
    return partition(costs, cells)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    sample: Sample,
    *,
    device: Device | None = None,
    param_scale: float = 2.0,
    chunks: int = 1,
) -> list[int]:
    """A balance evening out memory per cell (see layer_costs_by_size). `sample` is a whole
    mini-batch as you will train it; `chunks` the micro-batches it will be split into
    (torchgpipe's keyword), so activation sizes are counted per micro-batch."""
    module = check_module(module)
    cells = check_count(partitions, "partitions", len(module))
    costs = layer_costs_by_size(
        module, sample, device=device, param_scale=param_scale, chunks=chunks
    )
    return partition(costs, cells)


def _layer_count(module_or_len: object) -> int:
    if isinstance(module_or_len, nn.Module):
        if not isinstance(module_or_len, nn.Sequential):
            raise TypeError(
                "module_or_len must be a torch.nn.Sequential or a layer count, got "
                f"{type(module_or_len).__name__}"
            )
        if len(module_or_len) == 0:
            raise ValueError("module_or_len must have at least one layer")
        return len(module_or_len)
    return check_int(module_or_len, "module_or_len", 1)


def balance_by_costs(
    partitions: int,
    module_or_len: nn.Sequential | int,
    costs: Sequence[float] | Callable[[nn.Module], float],
) -> list[int]:
    """A balance evening out costs the caller knows: one number per layer, or a function giving
    a layer's cost (then `module_or_len` must be the module itself, not its length)."""
    layers = _layer_count(module_or_len)
    cells = check_count(partitions, "partitions", layers)
    if callable(costs):
        if not isinstance(module_or_len, nn.Sequential):
            raise TypeError(
                "costs is a function of a layer, so module_or_len must be the "
                "nn.Sequential itself, not a layer count"
            )
        values = [
            check_cost(costs(layer), f"costs(module[{i}])") for i, layer in enumerate(module_or_len)
        ]
    else:
        values = check_costs(costs, "costs")
        if len(values) != layers:
            raise ValueError(f"costs has {len(values)} entries, but there are {layers} layers")
    return partition(values, cells)

"""Argument checks shared by every layer: each names the bad argument in its error."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

from torch import nn


def check_count(value: object, name: str, layers: int) -> int:
    """`value` as a number of cells: an int in [1, layers]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    count = int(value)
    if count < 1:
        raise ValueError(f"{name} must be >= 1, got {count}")
    if count > layers:
        raise ValueError(f"{name} ({count}) must not exceed the number of layers ({layers})")
    return count


def check_cost(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    cost = float(value)
    if not math.isfinite(cost) or cost < 0.0:
        raise ValueError(f"{name} = {cost}: costs must be finite and non-negative")
    return cost


def check_costs(costs: object, name: str) -> list[float]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Iterable):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(costs).__name__}")
    checked = [check_cost(cost, f"{name}[{i}]") for i, cost in enumerate(costs)]
    if not checked:
        raise ValueError(f"{name} must not be empty")
    return checked


def check_module(module: object) -> nn.Sequential:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be a torch.nn.Sequential, got {type(module).__name__}")
    if len(module) == 0:
        raise ValueError("module must have at least one layer")
    return module


def check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0.0:
        raise ValueError(f"{name} must be finite and >= 0 seconds, got {value}")
    return seconds


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return str(value)


def check_balance(balance: object, cells: int, layers: int) -> list[int]:
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"balance must be a list of ints, got {type(balance).__name__}")
    sizes = [check_int(size, f"balance[{i}]", 1) for i, size in enumerate(balance)]
    if len(sizes) != cells:
        raise ValueError(f"balance has {len(sizes)} cells but partitions is {cells}")
    if sum(sizes) != layers:
        raise ValueError(f"balance {sizes} sums to {sum(sizes)}, but module has {layers} layers")
    return sizes

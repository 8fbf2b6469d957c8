"""Argument checks shared by every layer: each names the bad argument in its error."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Sequence

import torch
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


def check_non_negative(value: object, name: str, kind: str = "a number", unit: str = "") -> float:
    """`value` as a finite float >= 0; `kind` is what the TypeError says it must be, `unit`
    follows the bound in the ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number) or number < 0.0:
        raise ValueError(f"{name} must be finite and >= 0{unit}, got {value}")
    return number


def check_cost(value: object, name: str) -> float:
    """A layer's cost: check_non_negative, its ValueError naming the cost's value."""
    try:
        return check_non_negative(value, name)
    except ValueError:
        cost = float(value)  # type: ignore[arg-type]  # a real number, found above
        raise ValueError(f"{name} = {cost}: costs must be finite and non-negative") from None


def check_costs(costs: object, name: str) -> list[float]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Iterable):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(costs).__name__}")
    checked = [check_cost(cost, f"{name}[{i}]") for i, cost in enumerate(costs)]
    if not checked:
        raise ValueError(f"{name} must not be empty")
    return checked


def check_sequential(module: object) -> nn.Sequential:
    """`module` as an nn.Sequential, empty or not."""
    if not isinstance(module, nn.Sequential):
        hint = ""
        if isinstance(getattr(module, "_orig_mod", None), nn.Sequential):
            hint = (
                " (torch.compile of one): compile its layers instead, torch.compile(layer) "
                "for each, which run compiled in their cells"
            )
        raise TypeError(f"module must be a torch.nn.Sequential, got {type(module).__name__}{hint}")
    return module


def check_module(module: object) -> nn.Sequential:
    """`module` as an nn.Sequential of at least one layer."""
    module = check_sequential(module)
    if len(module) == 0:
        raise ValueError("module must have at least one layer")
    return module


def check_int(value: object, name: str, minimum: int, kind: str = "an int") -> int:
    """`value` as an int >= `minimum`; `kind` is what the TypeError says it must be."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_seconds(value: object, name: str) -> float:
    return check_non_negative(value, name, "a number of seconds", " seconds")


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return str(value)


def check_balance(
    balance: object, layers: int, *, cells: int | None = None, advice: str = ""
) -> list[int]:
    """`balance` as a list of cell sizes (each >= 1) summing to `layers`, of `cells` cells
    when given; `advice` ends the errors about a balance that does not fit the module."""
    more = f"; {advice}" if advice else ""
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"balance must be a list of ints, got {type(balance).__name__}")
    sizes: list[int] = []
    for i, size in enumerate(balance):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"balance[{i}] must be an int, got {type(size).__name__}")
        if size < 1:
            raise ValueError(f"balance[{i}] = {size}: every cell needs at least one layer{more}")
        sizes.append(int(size))
    if cells is not None and len(sizes) != cells:
        raise ValueError(f"balance has {len(sizes)} cells but partitions is {cells}")
    if not sizes and layers:
        raise ValueError(f"balance must name at least one cell{more}")
    if sum(sizes) != layers:
        raise ValueError(
            f"balance {sizes} sums to {sum(sizes)}, but module has {layers} layers{more}"
        )
    return sizes


CHECKPOINT_MODES = ("always", "except_last", "never")


def whole_number(value: object) -> int | None:
    """`value` as an int when it is one or converts to one without loss (42.0, a numpy int,
    a one-element integer tensor); None for anything else (2.5, "8", True)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        pass
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(float(value))
    return None


def check_chunks(chunks: object) -> int:
    count = whole_number(chunks)
    if count is None:
        raise TypeError(f"chunks must be an int, got {type(chunks).__name__} {chunks!r}")
    if count < 1:
        raise ValueError(f"chunks must be >= 1, got {count}")
    return count


def check_checkpoint(checkpoint: object) -> str:
    """The mode as a plain str: from a str (or a subclass, by its contents) or from an object
    whose str() is a mode (torchgpipe took str(checkpoint))."""
    mode = str.__str__(checkpoint) if isinstance(checkpoint, str) else str(checkpoint)
    if isinstance(checkpoint, bool) or mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    return mode


def check_timeout(
    timeout: object, name: str = "timeout", kind: str = "a number of seconds"
) -> float:
    """`timeout` as seconds > 0; `kind` is what the TypeError says it must be."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{name} must be {kind}, got {type(timeout).__name__}")
    if not timeout > 0:
        raise ValueError(f"{name} must be > 0 seconds, got {timeout}")
    return float(timeout)


def check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_devices(devices: object) -> list[torch.device]:
    if isinstance(devices, (str, torch.device, int)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a list of devices, got {type(devices).__name__}")
    resolved = []
    for i, device in enumerate(devices):
        try:
            resolved.append(torch.device(device))
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"devices[{i}] is not a device: {device!r}") from error
    for i, device in enumerate(resolved):
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"devices[{i}]: only cpu and cuda devices are supported, got {device}")
        if device.type == "cuda":
            resolved[i] = check_cuda_device(device, f"devices[{i}]")
    return resolved


def check_cuda_device(device: torch.device, name: str) -> torch.device:
    """`device` (a CUDA device) with its index, if this process has it: a CPU-only torch
    or a missing GPU is a ValueError naming `name`, before torch's own AssertionError."""
    if not torch.cuda.is_available():
        raise ValueError(
            f"{name} is {device}, but torch.cuda.is_available() is False (a CPU-only build "
            f"of torch, or no GPU visible): use 'cpu' devices, or leave devices out for the "
            f"default"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ValueError(f"{name} is cuda:{index}, but this process sees {count} CUDA devices")
    return torch.device("cuda", index)


REDUCTIONS = ("mean", "sum")


def check_loss_arguments(loss_fn: object, reduction: object) -> None:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")

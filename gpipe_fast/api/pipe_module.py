"""A pipe as an nn.Module: its layers in order, cast but never moved, copied or pickled."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any, NoReturn, Self, cast

import torch
from torch import Tensor, nn

Device = torch.device | str | int


class PipeModule(nn.Module):
    """What GPipe is as a module: the wrapped nn.Sequential's layers in order, whichever cell
    holds them (``len``, iteration, indexing); casting dtypes but no moving (each cell must
    stay on its own entry of ``devices``, which the workers, streams and boundary copies were
    built for); no deep copy or pickling (it owns worker threads)."""

    partitions: nn.ModuleList  # the cells (set by the pipe)

    def _cells(self) -> list[nn.Sequential]:
        return cast(list[nn.Sequential], list(self.partitions))

    def __len__(self) -> int:
        return sum(len(cell) for cell in self._cells())

    def __iter__(self) -> Iterator[nn.Module]:
        for cell in self._cells():
            yield from cell

    def __getitem__(self, index: int) -> nn.Module:
        """The layer at `index` of the wrapped module (negative from the end), whichever cell
        holds it."""
        try:
            position = operator.index(index)
        except TypeError:
            raise TypeError(
                f"GPipe layer indices must be integers, got {type(index).__name__}"
            ) from None
        layers = list(self)
        if not -len(layers) <= position < len(layers):
            raise IndexError(f"layer index {index} is out of range for {len(layers)} layers")
        return layers[position]

    # Moving is denied: each cell must stay on its own entry of self.devices, which the
    # workers, streams and boundary copies were built for. Casting dtypes is allowed.
    def cuda(self, device: int | torch.device | None = None) -> NoReturn:
        _deny_moving("cuda()")

    def cpu(self) -> NoReturn:
        _deny_moving("cpu()")

    def xpu(self, device: int | torch.device | None = None) -> NoReturn:
        _deny_moving("xpu()")

    def ipu(self, device: int | torch.device | None = None) -> NoReturn:
        _deny_moving("ipu()")

    def mtia(self, device: int | torch.device | None = None) -> NoReturn:
        _deny_moving("mtia()")

    def to_empty(self, *, device: Device | None, recurse: bool = True) -> NoReturn:
        _deny_moving("to_empty()")

    def to(self, *args: Any, **kwargs: Any) -> Self:
        """Casts (``to(torch.float64)``, ``to(dtype=...)``, ``to(memory_format=...)``); a
        device or a tensor to move to raises TypeError."""
        move = _move_in_to(args, kwargs)
        if move is not None:
            _deny_moving(move)
        return super().to(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(
            "a GPipe owns worker threads and cannot be deep-copied; copy the "
            "wrapped module and build a new GPipe"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a GPipe cannot be pickled; save pipe.state_dict() instead (it has "
            "the original module's keys)"
        )


def _move_in_to(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """How a call to Module.to(*args, **kwargs) would move the pipe, or None for a cast."""
    if "tensor" in kwargs or (args and isinstance(args[0], Tensor)):
        return "to(tensor)"
    if "device" in kwargs or (
        args and isinstance(args[0], (torch.device, str, int)) and not isinstance(args[0], bool)
    ):
        return "to(device)"
    return None


def _deny_moving(call: str) -> NoReturn:
    raise TypeError(
        f"pipe.{call}: a GPipe cannot be moved: each cell lives on its entry of pipe.devices, "
        "where its worker and streams run it, and moving would put the weights out of step "
        "with pipe.devices. To use other devices, build a new GPipe with devices=[...]; "
        "casting (pipe.half(), pipe.to(torch.float64)) is allowed"
    )

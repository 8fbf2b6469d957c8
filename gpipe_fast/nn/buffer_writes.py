"""Buffers a forward writes (spectral_norm's vectors, a layer's statistics), replayed by recompute.

A recompute runs from the values they had before the forward it redoes, and writes none of
them again."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

# A buffer of a cell, as (its module, its name there).
Place = tuple[nn.Module, str]
# The training flags of a cell's modules.
Mode = tuple[bool, ...]


class Snapshot:
    """The buffers a forward may write, as they were before it: per buffer its place, the
    tensor the module held, its version counter and a copy of its values; and the modules'
    mode (their training flags: which buffers a forward writes depends on it)."""

    __slots__ = ("items", "mode")

    def __init__(self, items: list[tuple[nn.Module, str, Tensor, int, Tensor]], mode: Mode) -> None:
        self.items = items
        self.mode = mode


class BufferWrites:
    """Which buffers of `module` its forward writes (per mode), learned on the first
    forward that the pipe will recompute (every buffer copied before it, those it changed
    kept: in place, by a new tensor, or through `.data`); BatchNorm's statistics (`frozen`)
    are left to their own freezing. Before each such forward the written buffers are copied;
    the recompute runs on the copies, so that it computes what the forward did
    (spectral_norm's weight from the vectors it started from) and leaves the buffers as
    they are."""

    def __init__(self, module: nn.Module, frozen: list[nn.Module]) -> None:
        self._module = module
        self._skipped = {id(m) for m in frozen}
        # mode -> the buffers its forward writes; absent: not seen yet.
        self._written: dict[Mode, list[Place]] = {}
        self.holds = bool(self._candidates())  # False: nothing to write, ever

    def _candidates(self) -> list[Place]:
        return [
            (owner, name)
            for owner in self._module.modules()
            if id(owner) not in self._skipped
            for name, buffer in owner._buffers.items()
            if buffer is not None
        ]

    def may_write(self, mode: Mode) -> bool:
        """False once a forward in this mode was seen writing no buffer (or the cell has
        none)."""
        written = self._written.get(mode)
        return self.holds and (written is None or bool(written))

    def written(self, mode: Mode) -> list[Place] | None:
        """The buffers a forward in this mode writes (None: not seen yet)."""
        return self._written.get(mode)

    def save(self, mode: Mode) -> Snapshot | None:
        """The buffers as they are before a forward that will be recomputed."""
        known = self._written.get(mode)
        places = self._candidates() if known is None else known
        if not places:
            return None
        with torch.no_grad():
            return Snapshot([
                (owner, name, buffer, buffer._version, buffer.clone())
                for owner, name in places
                if (buffer := owner._buffers.get(name)) is not None
            ], mode)  # fmt: skip

    def learn(self, snapshot: Snapshot | None) -> Snapshot | None:
        """After the forward of `snapshot`: on the first in its mode, which buffers it wrote
        (only theirs are kept, and copied from then on); the snapshot to replay, None if
        none."""
        if snapshot is None:
            return None
        if snapshot.mode not in self._written:
            kept = [item for item in snapshot.items if _changed(*item)]
            self._written[snapshot.mode] = [(owner, name) for owner, name, *_ in kept]
            snapshot.items = kept
        return snapshot if snapshot.items else None

    @contextmanager
    def replaying(self, snapshot: Snapshot | None) -> Iterator[None]:
        """The buffers as `snapshot` saved them while the recompute runs (on copies of their
        own, which it may write), then back to what they are."""
        if snapshot is None:
            yield
            return
        current = [(owner, name, owner._buffers.get(name)) for owner, name, *_ in snapshot.items]
        for owner, name, _, _, saved in snapshot.items:
            owner._buffers[name] = saved
        try:
            yield
        finally:
            for owner, name, tensor in current:
                owner._buffers[name] = tensor


def _changed(owner: nn.Module, name: str, before: Tensor, version: int, saved: Tensor) -> bool:
    now = owner._buffers.get(name)
    if now is not before:
        return True
    if now._version != version:
        return True
    # Written through .data (which has a version counter of its own): the values tell.
    return bool(now.shape != saved.shape or not torch.equal(now, saved))

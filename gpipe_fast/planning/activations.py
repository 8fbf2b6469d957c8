"""What a forward keeps for its backward, layer by layer: the storages autograd saves."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gpipe_fast.arguments import check_module
from gpipe_fast.balancing.profile import Sample, resolve_device
from gpipe_fast.nn.microbatch import as_tensors
from gpipe_fast.nn.pytree import Tree, tensors_of


@dataclass(frozen=True)
class ActivationProfile:
    """One forward with autograd of `rows` batch rows through the module, chained as the
    cells run it. Storages are numbered; each layer names the storages of its input, of its
    output and those autograd saved in it (parameters and buffers left out: they are counted
    as parameters). Bytes of everything but parameters scale with the batch rows."""

    rows: int
    storage_bytes: tuple[int, ...]
    inputs: tuple[frozenset[int], ...]
    outputs: tuple[frozenset[int], ...]
    saved: tuple[frozenset[int], ...]

    def bytes_of(self, keys: Iterable[int], rows: int) -> int:
        """Bytes of the storages `keys` for a micro-batch of `rows` rows."""
        return math.ceil(sum(self.storage_bytes[k] for k in keys) * rows / self.rows)

    def kept(self, layers: range, split: bool = False) -> frozenset[int]:
        """What a cell of `layers` holds per micro-batch until its backward: its input (the
        stash) and what its layers saved; with `split` (a backward split in halves, which
        runs the layers one by one) every layer's output too."""
        keys = set(self.inputs[layers.start])
        for index in layers:
            keys |= self.saved[index]
            if split:
                keys |= self.outputs[index]
        return frozenset(keys)

    def working(self, layers: range, rows: int) -> int:
        """Bytes a running task of the cell needs beyond what is kept: the largest layer's
        input and output together (an output being made, a gradient flowing through)."""
        return max(self.bytes_of(self.inputs[i] | self.outputs[i], rows) for i in layers)


class _Storages:
    """Numbers storages by their address; remembers their size."""

    def __init__(self) -> None:
        self.keys: dict[tuple[torch.device, int], int] = {}
        self.sizes: list[int] = []

    def key(self, tensor: Tensor) -> int:
        storage = tensor.untyped_storage()
        address = (tensor.device, storage.data_ptr())
        if address not in self.keys:
            self.keys[address] = len(self.sizes)
            self.sizes.append(storage.nbytes())
        return self.keys[address]

    def keys_of(self, value: Tree) -> frozenset[int]:
        return frozenset(self.key(t) for t in tensors_of(value))


def profile_activations(module: nn.Sequential, sample: Sample) -> ActivationProfile:
    """The storages one forward of `sample` keeps for its backward, per layer (see
    ActivationProfile), measured with saved-tensor hooks on the module itself where it lives
    (the sizes do not depend on the device), in training mode; its modes and buffers
    (BatchNorm's statistics) are restored afterwards, and no backward runs, so no ``.grad``
    changes. Everything stays alive until the end, so that no
    address is reused by another storage."""
    module = check_module(module)
    modes = [m.training for m in module.modules()]
    buffers = [b.detach().clone() for b in module.buffers()]
    try:
        module.train()
        return _profile(module, sample, resolve_device(None, module))
    finally:
        for submodule, mode in zip(module.modules(), modes, strict=True):
            submodule.training = mode
        with torch.no_grad():
            for buffer, before in zip(module.buffers(), buffers, strict=True):
                buffer.copy_(before)


def _profile(module: nn.Sequential, sample: Sample, target: torch.device) -> ActivationProfile:
    tensors = [t.detach().to(target, copy=True) for t in as_tensors(sample, "sample")]
    value: Tree = tuple(tensors) if isinstance(sample, tuple) else tensors[0]
    rows = min(t.size(0) for t in tensors)
    storages = _Storages()
    alive: list[object] = [value]
    inputs, outputs, saved = [], [], []
    for layer in module:
        own = {storages.key(t) for t in itertools.chain(layer.parameters(), layer.buffers())}
        seen: set[int] = set()

        def pack(tensor: Tensor, seen: set[int] = seen) -> Tensor:
            seen.add(storages.key(tensor))
            return tensor

        inputs.append(storages.keys_of(value))
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = layer(value)
        alive.append(value)
        outputs.append(storages.keys_of(value))
        saved.append(frozenset(seen - own))
    # Parameter storages were numbered too; none of them is in any set above but the inputs
    # of a layer fed a parameter itself, which is rare enough to count as an activation.
    return ActivationProfile(rows, tuple(storages.sizes), tuple(inputs), tuple(outputs),
                             tuple(saved))  # fmt: skip

"""Cells built on the meta device: memory, each layer's own initialisation, what none reached."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

InitFn = Callable[[nn.Module], None]


@dataclass(frozen=True)
class Uninitialised:
    """A tensor of a cell that came from the meta device and that no initialisation reached."""

    name: str  # the model's own key (cells keep the layers' names)
    module_type: str  # the class of the module holding it
    owner: nn.Module = field(repr=False, compare=False)
    attribute: str = field(repr=False, compare=False)

    def tensor(self) -> Tensor:
        """The tensor now (a load with assign=True replaces it)."""
        return getattr(self.owner, self.attribute)  # type: ignore[no-any-return]

    @property
    def in_state_dict(self) -> bool:
        """False for a non-persistent buffer (register_buffer(..., persistent=False), such as
        a rotary embedding's inv_freq): no state dict holds it, so no load can fill it."""
        return self.attribute not in self.owner._non_persistent_buffers_set


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Every submodule once, children before their parent: a parent's initialisation runs
    last, as it does when the module is constructed (nn.Transformer overwrites its layers')."""
    seen: set[int] = set()

    def walk(current: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
        if id(current) in seen:
            return
        seen.add(id(current))
        for name, child in current.named_children():
            yield from walk(child, f"{path}.{name}" if path else name)
        yield path, current

    yield from walk(module, prefix)


def _reset_method(module: nn.Module) -> Callable[[], None] | None:
    """The module's own initialisation: reset_parameters(), or torch's private
    _reset_parameters() (nn.MultiheadAttention, nn.Transformer) when it has only that."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method  # type: ignore[no-any-return]
    return None


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def _shared_places(modules: list[tuple[str, nn.Module]]) -> list[list[tuple[str, str]]]:
    """The places (module path, name) of each parameter held by several modules of a cell (a
    tied embedding and head in one cell): to_empty gives each place a tensor of its own."""
    places: dict[int, list[tuple[str, str]]] = {}
    for path, module in modules:
        for name, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((path, name))
    return [found for found in places.values() if len(found) > 1]


def _share_again(modules: list[tuple[str, nn.Module]], shared: list[list[tuple[str, str]]]) -> None:
    """Each shared parameter's places given the first place's new tensor again."""
    by_path = dict(modules)
    for (first_path, first_name), *others in shared:
        param = by_path[first_path]._parameters[first_name]
        for path, name in others:
            by_path[path]._parameters[name] = param


def _can_hold_nan(tensor: Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def materialize(
    cell: nn.Sequential, device: torch.device, init_fn: InitFn | None
) -> tuple[nn.Sequential, list[Uninitialised]]:
    """The cell on `device`. Built on the meta device (a model too big for one process), its
    tensors get memory there and each layer's own initialisation (reset_parameters), then
    `init_fn(module)` on every module when given; the tensors that none of it reached are
    returned. Floating tensors are filled with NaN first, so that a layer with no
    initialisation of its own (or one that leaves part of a tensor alone) shows; integer
    and bool tensors count as reached when their module has an initialisation or init_fn
    is given. Tensors not on the meta device keep their values."""
    modules = list(_post_order(cell))
    on_meta = {
        (path, name)
        for path, module in modules
        for name, tensor in _own_tensors(module)
        if tensor.is_meta
    }
    if not on_meta:
        return cell.to(device), []
    kept = {
        (path, name): tensor.detach()
        for path, module in modules
        for name, tensor in _own_tensors(module)
        if not tensor.is_meta
    }
    shared = _shared_places(modules)
    cell = cell.to_empty(device=device)
    modules = list(_post_order(cell))
    _share_again(modules, shared)
    reached: set[str] = set()  # modules with an initialisation of their own
    with torch.no_grad():
        for path, module in modules:
            for name, tensor in _own_tensors(module):
                if (path, name) in on_meta and _can_hold_nan(tensor):
                    tensor.fill_(float("nan"))
        for path, module in modules:
            reset = _reset_method(module)
            if reset is not None:
                reset()
                reached.add(path)
        if init_fn is not None:
            for _, module in modules:
                init_fn(module)
        for path, module in modules:
            for name, tensor in _own_tensors(module):
                if (path, name) in kept:
                    tensor.copy_(kept[(path, name)])
    left = []
    for path, module in modules:
        for name, tensor in _own_tensors(module):
            if (path, name) in on_meta and not _initialised(tensor, path in reached, init_fn):
                full = f"{path}.{name}" if path else name
                left.append(Uninitialised(full, type(module).__name__, module, name))
    return cell, left


def _initialised(tensor: Tensor, has_reset: bool, init_fn: InitFn | None) -> bool:
    if _can_hold_nan(tensor):
        return not bool(torch.isnan(tensor).any())
    return has_reset or init_fn is not None


def describe(left: list[Uninitialised], limit: int = 8) -> str:
    """ "2.w (Scale), 5.mlp.c_fc.weight (Conv1D), ..." for messages."""
    names = [f"{u.name} ({u.module_type})" for u in left[:limit]]
    more = f" and {len(left) - limit} more" if len(left) > limit else ""
    return ", ".join(names) + more


LOADABLE_ADVICE = (
    "their layers have no reset_parameters(); pass GPipe(..., init_fn=fn), which is called on "
    "every module of this process's cells after their own initialisation (e.g. a model's "
    "_init_weights), or load a checkpoint with pipe.load_state_dict(...) before the first step"
)
BUFFER_ADVICE = (
    "no state dict holds them, so no load can fill them: pass GPipe(..., init_fn=fn) with a "
    "function that re-creates them on their module (for transformers' rotary embeddings a "
    "model's own _init_weights does, e.g. init_fn=LlamaModel(config)._init_weights with that "
    "model built on the meta device), or set them by hand before the first step"
)


def explain(left: list[Uninitialised]) -> str:
    """Which tensors hold no values and how to fill them: those a state dict holds may also
    be loaded, a non-persistent buffer only re-created (init_fn) or set."""
    loadable = [u for u in left if u.in_state_dict]
    buffers = [u for u in left if not u.in_state_dict]
    parts = []
    if loadable:
        parts.append(f"{describe(loadable)}: {LOADABLE_ADVICE}")
    if buffers:
        parts.append(
            f"the non-persistent buffers (register_buffer(..., persistent=False)) "
            f"{describe(buffers)}: {BUFFER_ADVICE}"
        )
    return "; ".join(parts)


def warn_uninitialised(left: list[Uninitialised]) -> None:
    warnings.warn(
        f"gpipe_fast: {len(left)} tensor(s) built on the meta device were given memory but no "
        f"values: {explain(left)}. Until then the pipe refuses to run.",
        UserWarning,
        stacklevel=3,
    )


def still_uninitialised(left: list[Uninitialised]) -> list[Uninitialised]:
    """Those of `left` that nothing has filled since: a floating tensor holding no NaN any
    more was loaded or set by hand (integer ones leave the list when loaded, see Unfilled)."""
    return [u for u in left if not _can_hold_nan(u.tensor()) or bool(u.tensor().isnan().any())]


class Unfilled:
    """This process's tensors that came from the meta device with no values: the pipe runs
    once each is loaded or set (`check` raises until then)."""

    def __init__(self, left: list[Uninitialised]) -> None:
        self.left = left

    def __bool__(self) -> bool:
        return bool(self.left)

    def loaded(self, names: set[str]) -> None:
        """Forgets the tensors a state dict just loaded (the model's keys `names`)."""
        self.left = [u for u in self.left if u.name not in names]

    def check(self) -> None:
        """RuntimeError naming what still holds no values, and how to fill it."""
        if not self.left:
            return
        self.left = still_uninitialised(self.left)
        if self.left:
            raise RuntimeError(
                f"gpipe_fast: {len(self.left)} tensor(s) built on the meta device hold no "
                f"values yet: {explain(self.left)}"
            )

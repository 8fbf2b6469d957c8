"""Where a stage holds the model's modules and tensors: at their names in the model."""

from __future__ import annotations

from torch import Tensor, nn

from gpipe_fast.capture.plan import CapturePlan


def tensor_at(root: nn.Module, name: str) -> Tensor | None:
    """The parameter or buffer `name` under `root` (None where there is none)."""
    owner_name, _, attribute = name.rpartition(".")
    try:
        owner = root.get_submodule(owner_name) if owner_name else root
    except AttributeError:
        return None
    found = owner._parameters.get(attribute)
    return found if found is not None else owner._buffers.get(attribute)


def place(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Puts `module` at `fqn` under `root`, making plain containers on the way."""
    *path, last = fqn.split(".")
    owner = root
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    owner.add_module(last, module)


def place_tensor(root: nn.Module, model: nn.Module, name: str) -> None:
    """Puts the model's parameter or buffer `name` at its name under `root`, unless a module
    of the stage holds it there already."""
    *path, attribute = name.split(".")
    owner, source = root, model
    for part in path:
        source = source.get_submodule(part)
        child = owner._modules.get(part)
        if child is source:
            return  # a module of the stage holds it
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if source is model and owner is root and attribute in root._modules:
        return
    param = source._parameters.get(attribute)
    if param is not None:
        owner.register_parameter(attribute, param)
        return
    buffer = source._buffers.get(attribute)
    persistent = attribute not in source._non_persistent_buffers_set
    owner.register_buffer(attribute, buffer, persistent=persistent)


def uncovered(model: nn.Module, plan: CapturePlan) -> list[str]:
    """The model's parameters and buffers (by every name they have) that no stage holds under
    that name: neither inside an atom nor read by the glue of a stage."""
    atoms = {fqn for names in plan.atoms for fqn in names}
    read = {name for names in plan.reads for name in names}
    found = []
    for name, _ in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:  # fmt: skip
        parts = name.split(".")
        inside = any(".".join(parts[:n]) in atoms for n in range(1, len(parts)))
        if not inside and name not in read:
            found.append(name)
    return found

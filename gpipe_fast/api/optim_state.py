"""A pipe's optimizer state in torch.distributed.checkpoint: the plain model's, on every rank."""

from __future__ import annotations

import pickle
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Without flatten_optimizer_state_dict the optimizer's state dict holds param_groups, a list
# of groups each listing its parameters' names; DCP saves a value that is no tensor once, so
# every rank must hold the same list: the whole model's (see merge_param_groups).
WHOLE_MODEL_GROUPS = (
    "without StateDictOptions(flatten_optimizer_state_dict=True) a checkpoint holds one "
    "param_groups list for the whole model, so each param group needs the same settings on "
    "every rank of the pipe: build the same groups everywhere, or pass that option to "
    "get_state_dict and set_state_dict (it keys each parameter's group settings by its name)"
)


@dataclass
class PipeNames:
    """What the optimizer's state dict of a pipe across processes needs from the pipe."""

    # This rank's name of a tied weight -> the plain model's name for it (its first place),
    # where another rank holds that first place: the plain optimizer keys a tie by it.
    plain_names: dict[str, str]
    gather: Callable[[Any], list[Any]]  # a value from every rank of pp_group, in its order
    ranks: Sequence[int]  # the global ranks of pp_group, in its order


_pipes: weakref.WeakKeyDictionary[nn.Module, PipeNames] = weakref.WeakKeyDictionary()


def register(pipe: nn.Module, names: PipeNames) -> None:
    """get_state_dict(pipe, optimizer) and set_state_dict(pipe, optimizer, ...) will key the
    optimizer's state as the plain model's optimizer does, with or without the flatten
    option."""
    _install()
    _pipes[pipe] = names


def rename_parameters(pipe: nn.Module, rename: dict[str, str]) -> None:
    """Keys the optimizer state of `pipe`'s parameters named in `rename` by the plain model's
    names for them (a pipe of any model meets a parameter with several names, T5's shared
    embedding say, at another of its names first than the model does)."""
    if not rename:
        return
    names = _pipes.get(pipe)
    if names is None:  # one process: nothing to gather
        register(pipe, PipeNames(dict(rename), gather=lambda value: [value], ranks=[0]))
    else:
        names.plain_names.update(rename)


def tie_copy_names(
    ties: Iterable[Any], is_local: Callable[[int], bool], model_key: Callable[[str], str]
) -> dict[str, str]:
    """For each tie (gpipe_fast.nn.tied.Tie) whose first place is another rank's: the name
    this rank gives it (its first place here, as named_parameters() has it) -> the first.
    `model_key` turns a place's name in its cell into the model's key (with transparent
    layers the cell's own layer, a stage, is no part of it)."""
    names = {}
    for tie in ties:
        first_cell, first_name = tie.places[0]
        here = [name for cell, name in tie.places if is_local(cell)]
        if here and not is_local(first_cell):
            names[model_key(here[0])] = model_key(first_name)
    return names


def gather_over_pipeline(groups: Any, value: Any) -> list[Any]:
    """`value` (picklable) from every rank of the pipe's pp_group, in the group's order; each
    wait bounded by the pipe's guard (groups: gpipe_fast.distributed.ProcessGroups)."""
    layout, device, what = groups.layout, groups.device, "the optimizer's param groups"
    payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(layout.pp_size)]
    request = dist.all_gather(lengths, length, group=layout.pp_group, async_op=True)
    groups.guard.wait(request, what)
    sizes = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    parts = [torch.empty_like(padded) for _ in sizes]
    groups.guard.wait(dist.all_gather(parts, padded, group=layout.pp_group, async_op=True), what)
    return [
        pickle.loads(part[:size].cpu().numpy().tobytes())
        for part, size in zip(parts, sizes, strict=True)
    ]


Groups = list[dict[str, Any]]  # an optimizer state dict's param_groups


def merge_param_groups(every: Sequence[Groups | None], ranks: Sequence[int]) -> Groups:
    """The whole model's param groups from each rank's (None: a rank with no optimizer state
    dict): group i lists every rank's parameters of group i, with its settings, which must
    be the same on every rank (ValueError naming the difference otherwise)."""
    given = [(rank, groups) for rank, groups in zip(ranks, every, strict=True) if groups]
    if not given:
        return []
    first_rank, first = given[0]
    for rank, groups in given[1:]:
        if len(groups) != len(first):
            raise ValueError(
                f"gpipe_fast: the optimizer has {len(first)} param groups on rank {first_rank} "
                f"and {len(groups)} on rank {rank}; {WHOLE_MODEL_GROUPS}"
            )
        for i, (mine, theirs) in enumerate(zip(first, groups, strict=True)):
            for key in sorted((set(mine) | set(theirs)) - {"params"}):
                if key not in mine or key not in theirs or not _same(mine[key], theirs[key]):
                    raise ValueError(
                        f"gpipe_fast: param group {i} has {key}={mine.get(key, '(none)')!r} on "
                        f"rank {first_rank} and {key}={theirs.get(key, '(none)')!r} on rank "
                        f"{rank}; {WHOLE_MODEL_GROUPS}"
                    )
    return [
        {**group, "params": _unique(name for _, groups in given for name in groups[i]["params"])}
        for i, group in enumerate(first)
    ]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


def _renamed_nested(state: dict[str, Any], rename: dict[str, str]) -> dict[str, Any]:
    """A nested optimizer state dict ({"state": ..., "param_groups": ...}) with its parameter
    names renamed."""
    return {
        "state": {rename.get(name, name): value for name, value in state["state"].items()},
        "param_groups": [
            {**group, "params": _unique(rename.get(name, name) for name in group["params"])}
            for group in state["param_groups"]
        ],
    }


def _renamed_flat(state: dict[str, Any], rename: dict[str, str]) -> dict[str, Any]:
    """A flattened optimizer state dict ("state.<name>.<key>", "param_groups.<name>.<key>")
    with its parameter names renamed."""
    renamed = {}
    for key, value in state.items():
        section, _, rest = key.partition(".")
        for old, new in rename.items():
            if rest.startswith(old + "."):
                key = f"{section}.{new}{rest[len(old) :]}"
                break
        renamed[key] = value
    return renamed


def _check_listed(optimizers: Iterable[Any], state: dict[str, Any], info: Any) -> None:
    """Every parameter of the optimizers is in a loaded param group, whose settings it takes:
    torch would leave a parameter listed in none without lr (KeyError at the next step)."""
    listed = {name for group in state["param_groups"] for name in group["params"]}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                names = info.fqn_param_mapping.get(param, set())
                if names and not names & listed:
                    raise ValueError(
                        f"gpipe_fast: the optimizer state dict to load lists {min(names)!r} in "
                        "none of its param_groups, so that parameter would lose its group's "
                        "settings (lr, betas, ...): it holds another model's groups, or those "
                        "of one rank only"
                    )


def _install() -> None:
    """Wraps the two helpers of torch.distributed.checkpoint.state_dict that get and set an
    optimizer's state (its public get_/set_state_dict and get_/set_optimizer_state_dict call
    them), once: a model that is no registered pipe passes through unchanged."""
    try:
        from torch.distributed.checkpoint import state_dict as dsd
    except ImportError:  # a torch without get_state_dict
        return
    get = getattr(dsd, "_get_optim_state_dict", None)
    load = getattr(dsd, "_load_optim_state_dict", None)
    if get is None or load is None:  # a torch that moved them: said, never silently wrong
        warnings.warn(
            "gpipe_fast: this torch has no torch.distributed.checkpoint.state_dict."
            "_get_optim_state_dict / _load_optim_state_dict to key a pipe's optimizer state "
            "as the plain model's: pass StateDictOptions(flatten_optimizer_state_dict=True) to "
            "get_state_dict and set_state_dict, and keep a weight tied across ranks on one "
            "layout between save and load",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    if getattr(get, "_gpipe_fast", False):
        return

    def get_optim_state_dict(model: nn.Module, optimizers: Any, info: Any) -> Any:
        state = get(model, optimizers, info)
        names = _pipes.get(model)
        if names is None or not info.handle_optim:
            return state
        if info.flatten_optimizer_state_dict:
            return _renamed_flat(state, names.plain_names)
        mine = _renamed_nested(state, names.plain_names) if state else None
        groups = merge_param_groups(
            names.gather(mine["param_groups"] if mine else None), names.ranks
        )
        return {**mine, "param_groups": groups} if mine else state

    def load_optim_state_dict(model: nn.Module, optimizers: Any, state: Any, info: Any) -> Any:
        names = _pipes.get(model)
        if names is not None and info.handle_optim and state:
            local = {plain: mine for mine, plain in names.plain_names.items()}
            if "state" in state:  # nested, as torch tells the forms apart
                state = _renamed_nested(state, local)
                _check_listed(optimizers, state, info)
            else:
                state = _renamed_flat(state, local)
        return load(model, optimizers, state, info)

    get_optim_state_dict._gpipe_fast = True  # type: ignore[attr-defined]
    dsd._get_optim_state_dict = get_optim_state_dict
    dsd._load_optim_state_dict = load_optim_state_dict  # type: ignore[assignment]

"""Which of a model's keys name one tensor (ties), whichever ranks hold them."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from gpipe_fast.api.gpipe import GPipe, pipeline_of


def tie_groups(pipe: GPipe, model: nn.Module | None = None) -> list[list[str]]:
    """The groups of two or more keys that are one tensor: a weight tied across stages (the
    pipe keeps its copies in step on every rank), one shared within this rank's stages, and
    with `model` those its own modules share. Keys are the model's own, in its order."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    def join(keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys[1:]:
            parent[root(key)] = root(keys[0])

    pipeline = pipeline_of(pipe)
    if pipeline is not None and pipeline.tied:
        for tie in pipeline.tied.ties:  # a cell's names start with its layer (the stage)
            join(name.split(".", 1)[1] for _, name in tie.places)
    for named in (
        pipe.state_dict(keep_vars=True).items(),
        model.named_parameters(remove_duplicate=False) if model is not None else (),
        model.named_buffers(remove_duplicate=False) if model is not None else (),
    ):
        by_tensor: dict[int, list[str]] = {}
        for key, tensor in named:
            by_tensor.setdefault(id(tensor), []).append(key)
        for keys in by_tensor.values():
            join(keys)
    groups: dict[str, list[str]] = {}
    for key in parent:
        groups.setdefault(root(key), []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def aliases(groups: list[list[str]]) -> dict[str, list[str]]:
    """Each tied key -> the other keys of its tensor."""
    return {key: [other for other in keys if other != key] for keys in groups for key in keys}

"""What every rank of a pipe must build alike, compared across the ranks once, at build.

The ranks of a pipe each run the same program on their own arguments: one rank cutting the
model elsewhere, or at another chunk count, would train silently wrong or leave the others
waiting in a collective that never comes. So the arguments that must agree are compared
before anything else runs across the ranks: one all-gather of a digest per rank (every
rank of the job builds every pipe, as host_peers already asks). When they differ, every rank
gathers the others' arguments and raises the same ValueError, naming each argument that
differs and the ranks on each side."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d
from torch.nn.parameter import is_lazy

from gpipe_fast.distributed.process_groups import _attempt
from gpipe_fast.errors import PeerFailure

# Builds are made in the same order on every rank: their number keys their store entries.
_BUILDS = itertools.count()

# A tensor of a stage, as the ranks compare it: its name and its shape (None: not known yet,
# a lazy module's).
Entry = tuple[str, tuple[int, ...] | None]


def stage_parameters(cells: Iterable[nn.Module], drop_layer: bool = False) -> list[list[Entry]]:
    """Each stage's parameters by name and shape, as this rank's model has them (every
    stage's, not only this rank's: before any is materialised). `drop_layer`: the first part
    of a name (the stage's layer) is left out, for a pipe of any model keyed by its own names."""
    stages = []
    for cell in cells:
        entries: list[Entry] = []
        for name, parameter in cell.named_parameters():
            shape = None if is_lazy(parameter) else tuple(parameter.shape)
            entries.append((name.split(".", 1)[1] if drop_layer else name, shape))
        stages.append(entries)
    return stages


def agree(fields: Mapping[str, Any], timeout_s: float) -> None:
    """Compares `fields` (argument name -> value; each rank's, by the same code) across every
    rank of the default process group: returns when they are equal everywhere, else raises
    the same ValueError on every rank. A rank that does not take part within `timeout_s`
    (it refused its arguments, failed, or builds another pipe) is a PeerFailure naming it."""
    build = next(_BUILDS)
    # The parameters are compared as they are (to name the first that differs), the rest
    # by their repr.
    shown = {name: v if name == "parameters" else repr(v) for name, v in fields.items()}
    digest = hashlib.blake2b(repr(sorted(shown.items())).encode(), digest_size=7).digest()
    mine = torch.tensor([int.from_bytes(digest, "big")], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    _arrived(build)
    request = dist.all_gather(every, mine, async_op=True)
    _wait(request, build, timeout_s)
    if all(int(d) == int(mine) for d in every):
        return
    # They differ: every rank sees it, so every rank takes part in the second gather.
    given: list[Any] = [None] * len(every)
    dist.all_gather_object(given, shown)
    raise ValueError(differences(given))


def differences(given: Sequence[Mapping[str, Any]]) -> str:
    """The message naming each argument on which the ranks (by position in `given`) differ,
    and which ranks give which value."""
    names = list(dict.fromkeys(name for fields in given for name in fields))
    parts = []
    for name in names:
        values = [fields.get(name) for fields in given]
        sides = _sides(values)
        if len(sides) < 2:
            continue
        if name == "parameters":
            parts.append(_parameters(values, sides))
            continue
        parts.append(
            f"{name}: " + ", ".join(f"{_ranks(ranks)} gave {value}" for value, ranks in sides)
        )
    return (
        "gpipe_fast: the ranks built this pipe with different arguments, which every rank "
        "must give alike: " + "; ".join(parts)
    )


def _sides(values: Sequence[Any]) -> list[tuple[Any, list[int]]]:
    """The distinct values and the ranks that gave each, the most common first."""
    sides: list[tuple[Any, list[int]]] = []
    for rank, value in enumerate(values):
        for seen, ranks in sides:
            if seen == value:
                ranks.append(rank)
                break
        else:
            sides.append((value, [rank]))
    return sorted(sides, key=lambda side: (-len(side[1]), side[1][0]))


def _parameters(values: Sequence[Any], sides: list[tuple[Any, list[int]]]) -> str:
    """How each minority's stages differ from the most common ones: the first stage that
    differs, its tensor counts, and the first tensor that differs."""
    common, common_ranks = sides[0]
    parts = []
    for stages, ranks in sides[1:]:
        if len(stages) != len(common):
            parts.append(
                f"{_ranks(common_ranks)} {_have(common_ranks)} {len(common)} stages, "
                f"{_ranks(ranks)} {_have(ranks)} {len(stages)}"
            )
            continue
        k = next(k for k, (a, b) in enumerate(zip(common, stages, strict=True)) if a != b)
        a, b = common[k], stages[k]
        i = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        parts.append(
            f"stage {k}: {_ranks(common_ranks)} {_have(common_ranks)} {len(a)} tensors, "
            f"{_ranks(ranks)} {_have(ranks)} {len(b)}; the first that differs is {_entry(a, i)} on "
            f"{_ranks(common_ranks)}, {_entry(b, i)} on {_ranks(ranks)}"
        )
    return "the parameters (names and shapes) of each stage: " + "; ".join(parts)


def _entry(entries: Sequence[Any], index: int) -> str:
    if index >= len(entries):
        return "none"
    name, shape = entries[index]
    return f"{name!r} {list(shape) if shape is not None else '(not known yet)'}"


def _have(ranks: Sequence[int]) -> str:
    return "has" if len(ranks) == 1 else "have"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _key(build: int, rank: int) -> str:
    return f"gpipe_fast/attempt{_attempt()}/build{build}/{rank}"


def _arrived(build: int) -> None:
    """Says in the store that this rank reached the build's comparison (for the message of a
    rank that waited for it in vain)."""
    try:
        c10d._get_default_store().set(_key(build, dist.get_rank()), "1")
    except Exception:  # no store to say it in: the wait's message names no rank then
        pass


def _wait(request: Any, build: int, timeout_s: float) -> None:
    """Waits for the comparison's all-gather on this thread (Ctrl-C ends it), at most
    `timeout_s`; PeerFailure naming the ranks that never reached it."""
    start = time.monotonic()
    pause = 0.001
    while not request.is_completed():
        if time.monotonic() - start > timeout_s:
            raise PeerFailure(
                f"gpipe_fast: rank {dist.get_rank()} waited {timeout_s:g} s at the pipe's "
                f"build for {_missing(build)}, which did not reach it: every rank builds the "
                "pipe at once (a rank that refused its arguments raised that error there)"
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    request.wait()


def _missing(build: int) -> str:
    try:
        store = c10d._get_default_store()
        gone = [
            rank for rank in range(dist.get_world_size()) if not store.check([_key(build, rank)])
        ]
    except Exception:
        gone = []
    return _ranks(gone) if gone else "the other ranks"

"""Skippable models for the skip tests, each with a hand-written twin that has no skips."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gpipe_fast.skip import Namespace, pop, skippable, stash

WIDTH = 5


@skippable(stash=["down"])
class Down(nn.Module):
    """Stashes its input for the matching Up, returns a transformed one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("down", x)
        return torch.tanh(self.lin(x))


@skippable(pop=["down"])
class Up(nn.Module):
    """Adds what the matching Down stashed, scaled by a weight of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("down")
        return self.lin(x) + self.scale * skip


@skippable(stash=["a", "b"])
class StashTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("a", x * 2)
        yield stash("b", torch.sin(x))
        return self.lin(x)


@skippable(pop=["a"], stash=["c"])
class PopAStashC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        a = yield pop("a")
        y = self.lin(x) * a
        yield stash("c", y.cos())
        return y


@skippable(pop=["b", "c"])
class PopBC(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        c = yield pop("c")
        b = yield pop("b")
        return x + b - c


def unet(depth: int = 2) -> nn.Sequential:
    """Down x depth, a middle Linear, Up x depth: the same classes reused, each pair in its
    own namespace (outermost Down pairs with outermost Up)."""
    spaces = [Namespace() for _ in range(depth)]
    layers: list[nn.Module] = [Down().isolate(ns) for ns in spaces]
    layers.append(nn.Linear(WIDTH, WIDTH))
    layers += [Up().isolate(ns) for ns in reversed(spaces)]
    return nn.Sequential(*layers)


class UNetTwin(nn.Module):
    """unet()'s computation written out by hand, sharing its parameters."""

    def __init__(self, model: nn.Sequential, depth: int) -> None:
        super().__init__()
        self.model = model
        self.depth = depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = list(self.model)
        skips = []
        for down in layers[: self.depth]:
            skips.append(x)
            x = torch.tanh(down.lin(x))
        x = layers[self.depth](x)
        for up in layers[self.depth + 1 :]:
            x = up.lin(x) + up.scale * skips.pop()
        return x


def multi() -> nn.Sequential:
    """Two skips out of one layer, a layer that pops one and stashes another, a plain
    layer between, and a last layer popping two."""
    return nn.Sequential(StashTwo(), nn.Tanh(), PopAStashC(), nn.Linear(WIDTH, WIDTH), PopBC())


class MultiTwin(nn.Module):
    def __init__(self, model: nn.Sequential) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s2, tanh, pac, lin, _ = list(self.model)
        a, b = x * 2, torch.sin(x)
        x = tanh(s2.lin(x))
        y = pac.lin(x) * a
        c = y.cos()
        x = lin(y)
        return x + b - c


@skippable(stash=["ng", "idx"])
class StashNoGrad(nn.Module):
    """Stashes a tensor cut from the graph and an integer one: skips with no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("ng", x.detach() * 2)
        yield stash("idx", (x > 0).long())
        return self.lin(x)


@skippable(pop=["ng", "idx"])
class PopNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        ng = yield pop("ng")
        idx = yield pop("idx")
        assert not idx.is_floating_point()
        return self.lin(x) * ng + idx.to(x.dtype)


@skippable(stash=["none"])
class StashNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("none", None)
        return self.lin(x)


@skippable(pop=["none"])
class PopNone(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("none")
        assert skip is None
        return x * 2


@skippable(stash=["drop"])
class DropDown(nn.Module):
    """Stashes a dropout of its transformed input: the pipe must replay the same mask when
    it recomputes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        y = self.lin(x)
        yield stash("drop", self.dropout(y))
        return torch.tanh(y)


@skippable(pop=["drop"])
class DropUp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("drop")
        return self.lin(x) * skip


# Six layers cut into K cells (K = 2, 3, 4); the scenarios below place stashes and pops
# among them.
BALANCES = {2: [3, 3], 3: [2, 2, 2], 4: [2, 1, 1, 2]}


def linear() -> nn.Module:
    """A WIDTH-to-WIDTH Linear: the plain layers around the skippable ones."""
    return nn.Linear(WIDTH, WIDTH)


def _across() -> nn.Sequential:
    # Stashed in the first cell, popped in the last: spans every cell (K - 2 in between).
    return nn.Sequential(Down(), linear(), nn.Tanh(), linear(), nn.Tanh(), Up())


def _over_one() -> nn.Sequential:
    # K=2: from cell 0 to cell 1; K=3: over cell 1; K=4: over cells 1 and 2.
    return nn.Sequential(linear(), Down(), nn.Tanh(), linear(), Up(), linear())


def _inside() -> nn.Sequential:
    # K=2: both pairs inside a cell; K=3: the first inside, the second across; K=4: the
    # first inside, the second between neighbours.
    ns1, ns2 = Namespace(), Namespace()
    return nn.Sequential(
        Down().isolate(ns1), Up().isolate(ns1), linear(), Down().isolate(ns2), Up().isolate(ns2),
        linear(),
    )  # fmt: skip


def _multi() -> nn.Sequential:
    # Two skips from one stash point ("a", "b"), a layer that pops "a" and stashes "c", and
    # a last layer popping "b" and "c", from different cells.
    return nn.Sequential(linear(), StashTwo(), nn.Tanh(), PopAStashC(), linear(), PopBC())


def _no_grad() -> nn.Sequential:
    return nn.Sequential(StashNoGrad(), linear(), nn.Tanh(), linear(), linear(), PopNoGrad())


def _none() -> nn.Sequential:
    return nn.Sequential(linear(), StashNone(), nn.Tanh(), linear(), PopNone(), linear())


SCENARIOS: dict[str, Callable[[], nn.Sequential]] = {
    "across": _across,
    "over_one": _over_one,
    "inside": _inside,
    "multi": _multi,
    "no_grad": _no_grad,
    "none": _none,
}


def dropout() -> nn.Sequential:
    """A skip whose stashed tensor went through Dropout: a recomputation must replay its mask."""
    return nn.Sequential(linear(), DropDown(), nn.Tanh(), linear(), DropUp(), linear())

"""gpipe_fast.skip.verify: verify_skippables reports every unmatched stash and pop."""

from __future__ import annotations

import pytest
from torch import nn

from gpipe_fast.skip import Namespace, skippable, verify_skippables


@skippable(stash=["foo"])
class StashFoo(nn.Module):
    pass


@skippable(pop=["foo"])
class PopFoo(nn.Module):
    pass


@skippable(stash=["bar"], pop=["foo"])
class PopFooStashBar(nn.Module):
    pass


@skippable(pop=["bar"])
class PopBar(nn.Module):
    pass


@skippable(stash=["foo"], pop=["foo"])
class StashPopFoo(nn.Module):
    pass


def _problems(*layers: nn.Module) -> list[str]:
    with pytest.raises(TypeError) as info:
        verify_skippables(nn.Sequential(*layers))
    head, _, body = str(info.value).partition("\n\n")
    assert head == "one or more pairs of stash and pop do not match:"
    lines = body.split("\n")
    assert all(line.startswith("* ") for line in lines)
    return [line[2:] for line in lines]


def test_matching() -> None:
    verify_skippables(nn.Sequential(StashFoo(), nn.ReLU(), PopFoo()))
    verify_skippables(nn.Sequential(StashFoo(), PopFooStashBar(), PopBar()))
    verify_skippables(nn.Sequential(nn.ReLU()))
    verify_skippables(nn.Sequential())


def test_stash_not_popped() -> None:
    assert _problems(StashFoo()) == ["no module declared 'foo' as poppable but stashed"]


def test_pop_unknown() -> None:
    assert _problems(PopFoo()) == ["'0' declared 'foo' as poppable but it was not stashed"]


def test_stash_again() -> None:
    assert _problems(StashFoo(), StashFoo(), PopFoo()) == [
        "'1' redeclared 'foo' as stashable but not isolated by namespace"
    ]


def test_pop_again() -> None:
    assert _problems(StashFoo(), PopFoo(), PopFoo()) == [
        "'2' redeclared 'foo' as poppable but not isolated by namespace"
    ]


def test_stash_and_pop_same_name_in_one_layer() -> None:
    assert _problems(StashPopFoo()) == ["'0' declared 'foo' both as stashable and as poppable"]


def test_double_stash_pop() -> None:
    assert _problems(StashFoo(), PopFoo(), StashFoo(), PopFoo()) == [
        "'2' redeclared 'foo' as stashable but not isolated by namespace",
        "'3' redeclared 'foo' as poppable but not isolated by namespace",
    ]


def test_double_stash_pop_isolated() -> None:
    ns1, ns2 = Namespace(), Namespace()
    verify_skippables(
        nn.Sequential(
            StashFoo().isolate(ns1),
            PopFoo().isolate(ns1),
            StashFoo().isolate(ns2),
            PopFoo().isolate(ns2),
        )
    )


def test_pop_before_its_stash() -> None:
    # torchgpipe's wording for the pop, told why; the stash is not reported again.
    assert _problems(PopFoo(), nn.ReLU(), StashFoo()) == [
        "'0' declared 'foo' as poppable but it was not stashed: it is stashed after it, "
        "by '2'; a pop must follow its stash"
    ]


def test_pop_before_and_after_its_stash() -> None:
    assert _problems(PopFoo(), StashFoo(), PopFoo()) == [
        "'0' declared 'foo' as poppable but it was not stashed: it is stashed after it, "
        "by '1'; a pop must follow its stash"
    ]


def test_namespaces_are_told_apart() -> None:
    ns = Namespace()
    assert _problems(StashFoo().isolate(ns), PopFoo()) == [
        "'1' declared 'foo' as poppable but it was not stashed",
        "no module declared 'foo' as poppable but stashed",
    ]


def test_every_problem_listed_at_once_with_the_layer_names() -> None:
    model = nn.Sequential()
    model.add_module("enc", StashFoo())
    model.add_module("again", StashFoo())
    model.add_module("both", StashPopFoo())
    model.add_module("bar", PopBar())
    with pytest.raises(TypeError) as info:
        verify_skippables(model)
    assert str(info.value).split("\n\n")[1].split("\n") == [
        "* 'again' redeclared 'foo' as stashable but not isolated by namespace",
        "* 'both' declared 'foo' both as stashable and as poppable",
        "* 'bar' declared 'bar' as poppable but it was not stashed",
        "* no module declared 'foo' as poppable but stashed",
    ]


def test_only_direct_children_are_checked() -> None:
    # A pipe partitions the direct children only; nested skippables are not its business.
    verify_skippables(nn.Sequential(nn.Sequential(StashFoo())))

"""gpipe_fast.skip.namespace: Namespace identity, and isolate() to reuse a class."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from skip_models import WIDTH, Down, UNetTwin, Up, unet
from torch import nn

from gpipe_fast.skip import Namespace, pop, skippable, stash, verify_skippables


def test_distinct_per_instance() -> None:
    ns1, ns2 = Namespace(), Namespace()
    assert ns1 != ns2
    assert ns1 == ns1
    assert len({ns1, ns2}) == 2


@pytest.mark.parametrize(
    "duplicate",
    [copy.copy, copy.deepcopy, lambda ns: pickle.loads(pickle.dumps(ns))],
    ids=["copy", "deepcopy", "pickle"],
)
def test_copy_equals_original(duplicate) -> None:
    ns = Namespace()
    other = duplicate(ns)
    assert other == ns and other is not ns
    assert hash(other) == hash(ns)
    assert {ns: 1}[other] == 1


def test_compares_with_the_default_namespace_none() -> None:
    # torchgpipe registered None as a Namespace and crashed here (None has no .id).
    ns = Namespace()
    assert ns != None  # noqa: E711
    assert None != ns  # noqa: E711
    assert not (ns == None)  # noqa: E711
    assert None < ns and ns > None and not (ns < None)
    assert ns >= None and None <= ns
    keys = [(0, ns, "a"), (0, None, "a"), (0, Namespace(), "a")]
    assert sorted(keys)[0] == (0, None, "a")


def test_isolate_whole_layer_returns_it() -> None:
    ns = Namespace()
    layer = Down()
    assert layer.isolate(ns) is layer
    assert list(layer.stashable()) == [(ns, "down")]
    assert list(Down().stashable()) == [(None, "down")]  # other instances untouched


def test_isolate_only_some_names() -> None:
    @skippable(stash=["alice", "bob"], pop=["carol"])
    class StashStashPop(nn.Module):
        pass

    ns_alice, ns_bob = Namespace(), Namespace()
    layer = StashStashPop().isolate(ns_alice, only=["alice"]).isolate(ns_bob, only=["bob"])
    assert list(layer.stashable()) == [(ns_alice, "alice"), (ns_bob, "bob")]
    assert list(layer.poppable()) == [(None, "carol")]


def test_isolate_rejects_unknown_names_and_non_namespaces() -> None:
    with pytest.raises(ValueError, match="declares no skip named 'dwon'"):
        Down().isolate(Namespace(), only=["dwon"])
    with pytest.raises(TypeError, match="iterable of names"):
        Down().isolate(Namespace(), only="down")
    with pytest.raises(TypeError, match="takes a Namespace"):
        Down().isolate("ns")  # type: ignore[arg-type]


def test_same_class_twice_needs_namespaces() -> None:
    with pytest.raises(TypeError, match="redeclared 'down' as stashable"):
        verify_skippables(nn.Sequential(Down(), Down(), Up(), Up()))
    verify_skippables(unet(2))


def test_isolated_pairs_run_nested() -> None:
    model = unet(3)
    x = torch.randn(2, WIDTH)
    torch.testing.assert_close(model(x), UNetTwin(model, 3)(x))


def test_default_and_isolated_namespaces_mixed() -> None:
    # One pair in the default namespace around an isolated pair of the same name.
    ns = Namespace()
    model = nn.Sequential(Down(), Down().isolate(ns), Up().isolate(ns), Up())
    verify_skippables(model)
    x = torch.randn(2, WIDTH)
    d1, d2, u2, u1 = model
    h = torch.tanh(d1.lin(x))
    inner = u2.lin(torch.tanh(d2.lin(h))) + u2.scale * h
    torch.testing.assert_close(model(x), u1.lin(inner) + u1.scale * x)


def test_isolation_survives_deepcopy_and_pickle() -> None:
    model = unet(2)
    x = torch.randn(2, WIDTH)
    expected = model(x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        verify_skippables(clone)
        torch.testing.assert_close(clone(x), expected)


def test_namespaced_pop_does_not_see_the_default_namespace() -> None:
    @skippable(stash=["x"])
    class S(nn.Module):
        def forward(self, x):
            yield stash("x", x)
            return x

    @skippable(pop=["x"])
    class P(nn.Module):
        def forward(self, x):
            return (yield pop("x"))

    with pytest.raises(RuntimeError, match="'x' has not been stashed"):
        nn.Sequential(S(), P().isolate(Namespace()))(torch.ones(1))

"""gpipe_fast.skip.skippable: @skippable layers in a plain nn.Sequential, and their errors."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from skip_models import WIDTH, Down, MultiTwin, UNetTwin, Up, multi, unet
from torch import nn

from gpipe_fast.skip import Skippable, pop, skippable, stash
from gpipe_fast.skip.tracker import SkipTracker, use_skip_tracker


@pytest.fixture(autouse=True)
def _fresh_tracker():
    # Each test starts with an empty tracker, whatever an earlier test left behind.
    with use_skip_tracker(SkipTracker()) as tracker:
        yield tracker


def _run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    x = x.detach().clone().requires_grad_()
    out = model(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * weights).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def _assert_same(model: nn.Module, twin: nn.Module, x: torch.Tensor) -> None:
    out, x_grad, grads = _run(model, x)
    model.zero_grad()
    out_twin, x_grad_twin, grads_twin = _run(twin, x)
    torch.testing.assert_close(out, out_twin, rtol=0, atol=0)
    torch.testing.assert_close(x_grad, x_grad_twin, rtol=0, atol=0)
    assert len(grads) == len(grads_twin) == len(list(model.parameters()))
    for name_param, g, g_twin in zip(model.named_parameters(), grads, grads_twin, strict=True):
        torch.testing.assert_close(g, g_twin, rtol=0, atol=0, msg=f"grad of {name_param[0]}")


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_unet_matches_its_twin_outputs_and_every_gradient(depth: int) -> None:
    model = unet(depth).double()
    twin = UNetTwin(model, depth)
    for _ in range(3):  # fresh random inputs each time, the same tracker throughout
        _assert_same(model, twin, torch.randn(4, WIDTH, dtype=torch.float64))
        model.zero_grad()


def test_several_skips_per_layer_match_the_twin() -> None:
    model = multi().double()
    _assert_same(model, MultiTwin(model), torch.randn(3, WIDTH, dtype=torch.float64))


def test_pop_returns_the_stashed_object_itself() -> None:
    seen: list[torch.Tensor] = []

    @skippable(stash=["x"])
    class S(nn.Module):
        def forward(self, x):
            seen.append(x)
            yield stash("x", x)
            return x + 1

    @skippable(pop=["x"])
    class P(nn.Module):
        def forward(self, x):
            skip = yield pop("x")
            seen.append(skip)
            return x

    nn.Sequential(S(), P())(torch.ones(2))
    assert seen[0] is seen[1]


def test_none_skip() -> None:
    @skippable(stash=["none"])
    class S(nn.Module):
        def forward(self, x):
            yield stash("none", None)
            return x * 2

    @skippable(pop=["none"])
    class P(nn.Module):
        def forward(self, x):
            none = yield pop("none")
            assert none is None
            return x + 1

    x = torch.rand(3, requires_grad=True)
    out = nn.Sequential(S(), P())(x)
    out.sum().backward()
    torch.testing.assert_close(out, x.detach() * 2 + 1)
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_no_grad_and_eval() -> None:
    model = unet(2).eval()
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, UNetTwin(model, 2)(x).detach())


def test_forward_without_yield_and_without_declarations() -> None:
    @skippable()
    class Plain(nn.Module):
        def forward(self, x):
            return x * 3

    torch.testing.assert_close(Plain()(torch.ones(2)), torch.full((2,), 3.0))


def test_arguments_and_keywords_reach_forward() -> None:
    @skippable(stash=["s"])
    class TwoArgs(nn.Module):
        def forward(self, x, y, *, scale=1.0):
            yield stash("s", y)
            return (x + y) * scale

    @skippable(pop=["s"])
    class TupleOut(nn.Module):
        def forward(self, x):
            s = yield pop("s")
            return x, s

    a, b = torch.ones(2), torch.full((2,), 2.0)
    out = TwoArgs()(a, b, scale=2.0)
    torch.testing.assert_close(out, torch.full((2,), 6.0))
    first, second = TupleOut()(out)
    assert first is out and second is b


def test_decorated_class_keeps_original_as_base_name_and_constructor() -> None:
    class Original(nn.Module):
        """Doc."""

        def __init__(self, width: int, *, bias: bool = True) -> None:
            super().__init__()
            self.lin = nn.Linear(width, width, bias=bias)

        def forward(self, x):
            yield stash("x", x)
            return self.lin(x)

    Decorated = skippable(stash=["x"])(Original)
    layer = Decorated(3, bias=False)
    assert issubclass(Decorated, Original) and issubclass(Decorated, Skippable)
    assert isinstance(layer, Original) and isinstance(layer, Skippable)
    assert Decorated.__name__ == "Original"
    assert Decorated.__qualname__ == Original.__qualname__
    assert Decorated.__module__ == Original.__module__
    assert Decorated.__doc__ == "Doc."
    assert layer.lin.bias is None
    # Parameters keep their own names: no wrapper prefix in state_dict.
    assert list(layer.state_dict()) == ["lin.weight"]
    assert Decorated.stashable_names == frozenset({"x"})
    assert Decorated.poppable_names == frozenset()


def test_repr() -> None:
    @skippable(stash=["hello"])
    class Hello(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x):
            yield stash("hello", x)
            return self.conv(x)

    assert repr(Hello()) == (
        "@skippable(Hello(\n  (conv): Conv2d(1, 1, kernel_size=(1, 1), stride=(1, 1))\n))"
    )
    assert repr(nn.Sequential(Hello())).splitlines()[1] == "  (0): @skippable(Hello("


def test_forward_hooks_see_the_output() -> None:
    seen: list[torch.Tensor] = []
    layer = Down()
    layer.register_forward_hook(lambda module, args, output: seen.append(output))
    out = nn.Sequential(layer, Up())[0](torch.ones(1, WIDTH))
    assert seen == [out]


def test_subclass_of_a_decorated_class_overriding_forward() -> None:
    class DoubleDown(Down):
        def forward(self, x):
            yield stash("down", x * 2)
            return x

    x = torch.ones(1, WIDTH)
    up = Up()
    out = nn.Sequential(DoubleDown(), up)(x)
    torch.testing.assert_close(out, up.lin(x) + up.scale * x * 2)


def test_decorating_again_replaces_the_declarations() -> None:
    Renamed = skippable(stash=["other"])(Down)
    with pytest.raises(RuntimeError, match=r"'down' has not been declared as stashable"):
        Renamed()(torch.ones(1, WIDTH))


def test_deepcopy_keeps_skips_paired() -> None:
    model = unet(2)
    clone = copy.deepcopy(model)
    x = torch.randn(2, WIDTH)
    torch.testing.assert_close(clone(x), model(x))


def test_threads_do_not_share_skips() -> None:
    # Each thread has its own default tracker: concurrent models never pop each
    # other's skips.
    model = unet(2)
    x = torch.randn(2, WIDTH)
    expected = UNetTwin(model, 2)(x).detach()
    failures: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work() -> None:
        try:
            barrier.wait()
            for _ in range(50):
                torch.testing.assert_close(model(x).detach(), expected)
        except BaseException as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


# Errors, as torchgpipe raises them.


def test_stash_not_declared() -> None:
    @skippable()
    class S(nn.Module):
        def forward(self, x):
            yield stash("foo", x)
            return x

    with pytest.raises(RuntimeError, match=r"^'foo' has not been declared as stashable$"):
        S()(torch.ones(1))


def test_pop_not_declared(_fresh_tracker: SkipTracker) -> None:
    @skippable(stash=["foo"])
    class S(nn.Module):
        def forward(self, x):
            yield stash("foo", x)
            return x

    @skippable()
    class P(nn.Module):
        def forward(self, x):
            return (yield pop("foo"))

    S()(torch.ones(1))
    with pytest.raises(RuntimeError, match=r"^'foo' has not been declared as poppable$"):
        P()(torch.ones(1))
    assert list(_fresh_tracker.tensors) == [(None, "foo")]  # still there: nothing popped


def test_pop_not_stashed() -> None:
    with pytest.raises(RuntimeError, match=r"^'down' has not been stashed$"):
        Up()(torch.ones(1, WIDTH))


def test_declared_but_not_stashed_at_end_of_forward() -> None:
    @skippable(stash=["foo", "bar"])
    class S(nn.Module):
        def forward(self, x):
            return x * 2

    with pytest.raises(RuntimeError, match=r"^'bar', 'foo' must be stashed but have not$"):
        S()(torch.ones(1))


def test_declared_but_not_stashed_with_a_generator() -> None:
    @skippable(stash=["foo", "bar"])
    class S(nn.Module):
        def forward(self, x):
            yield stash("foo", x)
            return x

    with pytest.raises(RuntimeError, match=r"^'bar' must be stashed but have not$"):
        S()(torch.ones(1))


def test_declared_but_not_popped(_fresh_tracker: SkipTracker) -> None:
    @skippable(pop=["down"])
    class P(nn.Module):
        def forward(self, x):
            return x

    Down()(torch.ones(1, WIDTH))
    with pytest.raises(RuntimeError, match=r"^'down' must be popped but have not$"):
        P()(torch.ones(1, WIDTH))


def test_popped_twice(_fresh_tracker: SkipTracker) -> None:
    @skippable(pop=["down"])
    class P(nn.Module):
        def forward(self, x):
            yield pop("down")
            yield pop("down")
            return x

    Down()(torch.ones(1, WIDTH))
    with pytest.raises(RuntimeError, match=r"^'down' has already been popped$"):
        P()(torch.ones(1, WIDTH))


def test_stashed_twice_keeps_the_last(_fresh_tracker: SkipTracker) -> None:
    @skippable(stash=["down"])
    class S(nn.Module):
        def forward(self, x):
            yield stash("down", x)
            yield stash("down", x + 1)
            return x

    x = torch.zeros(1, WIDTH)
    S()(x)
    torch.testing.assert_close(_fresh_tracker.tensors[(None, "down")], x + 1)


def test_not_a_command() -> None:
    @skippable()
    class Y(nn.Module):
        def forward(self, x):
            yield x
            return x

    with pytest.raises(TypeError, match=r"is not a command from @skippable"):
        Y()(torch.ones(1))


def test_error_raises_at_the_yield_and_closes_the_generator() -> None:
    events: list[str] = []

    @skippable(pop=["foo"])
    class P(nn.Module):
        def forward(self, x):
            try:
                yield pop("foo")
            except RuntimeError:
                events.append("raised at the yield")
                raise
            finally:
                events.append("closed")
            return x

    with pytest.raises(RuntimeError, match=r"'foo' has not been stashed"):
        P()(torch.ones(1))
    assert events == ["raised at the yield", "closed"]


def test_a_failing_forward_stashes_nothing(_fresh_tracker: SkipTracker) -> None:
    @skippable(stash=["foo"])
    class S(nn.Module):
        def forward(self, x):
            yield stash("foo", x)
            raise ValueError("boom")

    with pytest.raises(ValueError, match=r"boom"):
        S()(torch.ones(1))
    assert _fresh_tracker.tensors == {}


def test_decorator_arguments() -> None:
    with pytest.raises(TypeError, match=r"iterable of names"):
        skippable(stash="foo")
    with pytest.raises(TypeError, match=r"skip names are strs"):
        skippable(pop=[1])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"decorates an nn\.Module class"):
        skippable()(object)  # type: ignore[arg-type]

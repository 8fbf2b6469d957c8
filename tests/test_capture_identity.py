"""capture/identity.py: a glue value's key is what makes it, the same in every run of a forward,
whatever other ops run beside it and whatever the micro-batch's shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gpipe_fast.capture.identity import Identities, Key, KeyedRun, in_place, op_name


class _Recording(KeyedRun):
    """Keys every glue op's outputs and remembers them in order."""

    def __init__(self, identities: Identities, add: bool) -> None:
        super().__init__(identities, add)
        self.made: list[Key] = []

    def after_op(self, name: str, inputs: Any, out: Any, leaves: Any, made: Any) -> Any:
        self.made.extend(key for _, _, key in made)
        return out


def _keys(
    identities: Identities, add: bool, body: Callable[[Tensor], Any], x: Tensor
) -> tuple[_Recording, Any]:
    run = _Recording(identities, add)
    run.keys.set(x, run.keys.intern(("input", "x")))
    with run.enter():
        out = body(x)
    return run, out


def test_a_value_keeps_its_key_when_other_ops_run_beside_it() -> None:
    identities = Identities()

    def planned(x: Tensor) -> Tensor:
        return (x * 2 + 1).sum(-1)

    def staged(x: Tensor) -> Tensor:
        x.device, x.abs().max()  # reads and checks of its own (a real tensor's, say)
        y = x * 2
        torch.zeros(3)  # a tensor made from nothing
        return (y + 1).sum(-1)

    plan, want = _keys(identities, True, planned, torch.randn(2, 3))
    stage, got = _keys(identities, False, staged, torch.randn(2, 3))
    assert stage.keys.of(got) == plan.keys.of(want) is not None


def test_shapes_do_not_enter_a_key_and_other_constants_do() -> None:
    identities = Identities()
    plan, want = _keys(
        identities, True, lambda x: x.reshape(x.shape[0], -1) * 0.5, torch.randn(2, 3)
    )
    stage, got = _keys(identities, False, lambda x: x.reshape(x.shape[0], -1) * 0.5,
                       torch.randn(5, 3))  # fmt: skip
    assert stage.keys.of(got) == plan.keys.of(want)
    other, scaled = _keys(identities, False, lambda x: x.reshape(x.shape[0], -1) * 0.25,
                          torch.randn(2, 3))  # fmt: skip
    assert other.keys.of(scaled) is None  # another constant: another value, unknown to the plan


def test_the_nth_of_the_same_op_is_another_value() -> None:
    identities = Identities()
    run, (first, second) = _keys(identities, True, lambda x: (x.exp(), x.exp()), torch.randn(2))
    assert run.keys.of(first) != run.keys.of(second)


def test_an_input_passed_through_keeps_its_key_and_a_write_in_place_gives_a_new_one() -> None:
    identities = Identities()

    def body(x: Tensor) -> tuple[Tensor, Key, Key]:
        y = x + 1
        before = run.keys.of(y)
        z = torch.nn.functional.dropout(y, 0.5, training=False)  # returns y itself
        assert z is y and run.keys.of(z) == before
        y.mul_(2)
        return y, before, run.keys.of(y)

    run = _Recording(identities, True)
    run.keys.set(x := torch.randn(3), run.keys.intern(("input", "x")))
    with run.enter():
        _, before, after = body(x)
    assert before is not None and after is not None and before != after


def test_what_a_stage_never_planned_has_no_key_nor_anything_made_from_it() -> None:
    identities = Identities()
    _keys(identities, True, lambda x: x + 1, torch.randn(2))
    stage, got = _keys(identities, False, lambda x: (x - 1) + 1, torch.randn(2))
    assert stage.keys.of(got) is None


def test_an_atom_suspends_the_glue_mode() -> None:
    run = _Recording(Identities(), True)
    x = torch.randn(2)
    with run.enter():
        with run.suspended():
            inside = x * 3  # an atom's own op: not glue
        outside = x * 3
    assert run.made == [run.keys.of(outside)]
    assert inside is not None


def test_names_of_ops() -> None:
    assert op_name(torch.add) == "torch.add"
    assert op_name(Tensor.add_) == "Tensor.add_"
    assert op_name(Tensor.shape.__get__) == "Tensor.shape"
    assert op_name(torch.nn.functional.dropout) == "torch.nn.functional.dropout"
    assert in_place("Tensor.add_") and in_place("Tensor.__iadd__")
    assert in_place("Tensor.__setitem__") and not in_place("Tensor.__add__")
    assert not in_place("torch.add")

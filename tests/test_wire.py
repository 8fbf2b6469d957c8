"""The header ahead of each boundary message: structure, dtypes and shapes survive the trip."""

from __future__ import annotations

import ctypes
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from gpipe_fast.transport import wire

CPU = torch.device("cpu")


def _round_trip(payload: wire.Payload) -> wire.Payload:
    """`payload` as gloo carries a message too large to inline: its header, then its
    tensors (a pytree's pickled rest among them)."""
    payload = wire.packed(payload)
    form, entries = wire.read_header(wire.encode(payload, CPU))
    sent = iter(wire.tensors(payload))
    received = []
    for entry in entries:
        if entry is None:
            received.append(None)
            continue
        dtype, shape = entry
        tensor = next(sent)
        assert (tensor.dtype, tuple(tensor.shape)) == (dtype, shape)
        received.append(tensor.clone())
    return wire.assemble(form, received)


def test_a_lone_tensor_stays_a_tensor() -> None:
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    got = _round_trip(x)
    assert isinstance(got, torch.Tensor) and torch.equal(got, x)


def test_a_tuple_keeps_its_missing_gradients_and_dtypes() -> None:
    payload = (torch.randn(2, 3), None, torch.arange(4), torch.zeros((), dtype=torch.bfloat16))
    got = _round_trip(payload)
    assert isinstance(got, tuple) and len(got) == 4 and got[1] is None
    for a, b in zip(got, payload, strict=True):
        if a is not None:
            assert torch.equal(a, b) and a.dtype == b.dtype


def test_shapes_may_change_from_one_message_to_the_next() -> None:
    for rows in (32, 48, 30, 1):
        assert _round_trip(torch.ones(rows, 7)).shape == (rows, 7)  # type: ignore[union-attr]


def test_too_many_tensors_for_a_header_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="at most 128 fit"):
        wire.encode(tuple(torch.ones(1, 1, 1, 1) for _ in range(30)), CPU)


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot send tensors of dtype"):
        wire.encode(torch.zeros(2, dtype=torch.uint16), CPU)


def test_a_message_that_is_no_header_is_named() -> None:
    with pytest.raises(RuntimeError, match="did not start with a gpipe_fast header"):
        wire.read_header(torch.zeros(wire.HEADER_LENGTH, dtype=torch.int64))


@pytest.mark.parametrize(
    "payload",
    [
        torch.randn(16, 128),
        (torch.randn(3, 5).double(), None, torch.tensor([True, False, True])),
        (torch.randn(2, 3).bfloat16(), torch.arange(7), torch.randn(2).to(torch.complex64)),
        torch.zeros(0, 4),
    ],
)
def test_small_tensors_travel_inside_the_header_message(payload: object) -> None:
    message = wire.encode(payload, CPU, wire.INLINE_BYTES)  # type: ignore[arg-type]
    assert message.numel() == wire.HEADER_LENGTH + wire.INLINE_BYTES // 8  # one fixed size
    assert wire.is_inline(message)
    received = message.clone()  # what the receiver's posted buffer holds
    got = wire.message(received.numpy())
    want = payload if isinstance(payload, tuple) else (payload,)
    got_entries = got if isinstance(got, tuple) else (got,)
    assert isinstance(got, tuple) == isinstance(payload, tuple)
    for g, w in zip(got_entries, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


def test_large_tensors_follow_their_header() -> None:
    big = torch.randn(wire.INLINE_BYTES // 4 + 1)  # one float more than the room
    message = wire.encode(big, CPU, wire.INLINE_BYTES)
    assert not wire.is_inline(message)
    assert not wire.is_inline(wire.encode(torch.randn(2), CPU))  # no room: header alone


def _gathered(payload: wire.Payload) -> bytearray:
    """`payload` as a shared-memory message arrives: its host header, then each tensor at an
    offset aligned to wire.ALIGN (the channel's gathering)."""
    out = bytearray()
    message = wire.gather(payload)  # held while its parts are read
    for address, size in message.parts:  # read as the ring copies them
        out += ctypes.string_at(address, size)
        out += bytes(-len(out) % wire.ALIGN)
    return out


def test_a_shared_memory_message_carries_structure_dtypes_and_shapes() -> None:
    payload = (
        torch.arange(3, dtype=torch.int8),  # 3 bytes: the next tensor starts 16 bytes on
        None,
        torch.randn(2, 5, dtype=torch.float64),
        torch.zeros(0, 4),  # empty
        torch.ones((), dtype=torch.bfloat16),
        torch.randn(3, 4).t(),  # not contiguous: sent contiguous
    )
    got = wire.message(_gathered(payload))
    assert isinstance(got, tuple) and len(got) == len(payload) and got[1] is None
    for a, b in zip(got, payload, strict=True):
        if b is not None:
            assert a is not None and a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)
    lone = torch.randn(7, 3)
    assert torch.equal(wire.message(_gathered(lone)), lone)  # type: ignore[arg-type]


def test_a_shared_memory_message_views_the_received_bytes() -> None:
    received = _gathered(torch.zeros(4))
    got = wire.message(received)
    received[wire.HEADER_LENGTH * 8] = 0x3F  # the tensor is the buffer, not a copy of it
    assert isinstance(got, torch.Tensor) and got[0].item() != 0.0


def test_a_shared_memory_message_that_is_no_header_is_named() -> None:
    with pytest.raises(RuntimeError, match="did not start with a gpipe_fast header"):
        wire.message(bytearray(wire.HEADER_LENGTH * 8))


Pair = namedtuple("Pair", ["h", "scale"])

PYTREES = {
    "dict": lambda: {"h": torch.randn(3, 4).double(), "mask": torch.randn(3, 4) > 0, "n": 3},
    "tuple with None and an int": lambda: (torch.randn(2, 3), None, torch.randn(3, 2).t(), 3),
    "namedtuple": lambda: Pair(torch.randn(2, 2).bfloat16(), 0.5),
    "nested": lambda: [torch.arange(4), {"deep": (None, True, "s", torch.zeros(0, 2))}],
    "no tensor": lambda: {"only": "values", "n": None},
}


def _assert_same_tree(got: Any, want: Any) -> None:
    """Same structure and types, equal other leaves, equal tensors of the same dtype and
    shape."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec and type(got) is type(want)
    for a, b in zip(got_leaves, want_leaves, strict=True):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape)
            assert torch.equal(a, b)
        else:
            assert type(a) is type(b) and a == b


@pytest.mark.parametrize("name", list(PYTREES))
def test_a_pytree_round_trips_every_way_it_travels(name: str) -> None:
    payload = PYTREES[name]()
    _assert_same_tree(_round_trip(payload), payload)  # gloo, header then tensors
    message = wire.encode(payload, CPU, wire.INLINE_BYTES)
    assert wire.is_inline(message)
    _assert_same_tree(wire.message(message.numpy()), payload)  # gloo, one message
    _assert_same_tree(wire.message(_gathered(payload)), payload)  # shared memory


def test_a_lone_tensor_and_a_tuple_of_tensors_are_not_pickled() -> None:
    # The common cases keep the header alone: the payload itself is its message's entries.
    x, pair = torch.randn(2), (torch.randn(2), None, torch.randn(3))
    assert wire.packed(x) is x and wire.packed(pair) is pair
    assert isinstance(wire.packed((x, 3)), wire.Packed)  # an int: pickled with the structure


def test_a_leaf_that_cannot_be_pickled_is_named() -> None:
    with pytest.raises(TypeError, match=r"cannot be pickled.*other leaves are: function"):
        wire.gather({"h": torch.randn(2), "f": lambda: 0})

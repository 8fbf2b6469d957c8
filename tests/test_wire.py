"""The header ahead of each boundary message: structure, dtypes and shapes survive the trip."""

from __future__ import annotations

import pytest
import torch

from gpipe_fast.transport import wire

CPU = torch.device("cpu")


def _round_trip(payload: wire.Payload) -> wire.Payload:
    is_tuple, entries = wire.layout(wire.encode(payload, CPU))
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
    return wire.assemble(is_tuple, received)


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
        wire.layout(torch.zeros(wire.HEADER_LENGTH, dtype=torch.int64))

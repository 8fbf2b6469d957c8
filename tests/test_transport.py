"""The in-process Transport: a mailbox per step (its conformance: test_transport_conformance.py)."""

from __future__ import annotations

import torch

from gpipe_fast.device.streams import CellStreams
from gpipe_fast.transport.local import LocalTransport
from gpipe_fast.transport.protocol import ACTIVATION, GRADIENT


def _local(stages: int = 3) -> LocalTransport:
    devices = [torch.device("cpu")] * stages
    return LocalTransport(CellStreams(devices, list(range(stages))), devices)


def test_activations_go_to_the_next_stage_and_gradients_to_the_one_before() -> None:
    transport = _local()
    x = torch.randn(2, 3, requires_grad=True)
    g = torch.randn(2, 3)
    transport.send(ACTIVATION, 0, 1, x)
    transport.send(GRADIENT, 2, 1, (g, None))
    assert transport.pending() == 2
    got = transport.recv(ACTIVATION, 1, 1)
    assert isinstance(got, torch.Tensor) and torch.equal(got, x) and not got.requires_grad
    grads = transport.recv(GRADIENT, 1, 1)
    assert isinstance(grads, tuple) and torch.equal(grads[0], g) and grads[1] is None
    assert transport.pending() == 0


def test_communication_calls_are_no_ops_in_one_process() -> None:
    transport = _local()
    transport.deliver(ACTIVATION, 0, 0, torch.ones(1))
    transport.expect(iter(()))
    transport.post(ACTIVATION, 0, 0)
    transport.fetch(ACTIVATION, 1, 0)
    transport.finish()
    assert transport.pending() == 1  # the delivered value waits for its recv
    assert torch.equal(transport.recv(ACTIVATION, 0, 0), torch.ones(1))  # type: ignore[arg-type]

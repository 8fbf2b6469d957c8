"""The Transport protocol's conformance scenario, run over each transport (in one process, or
on both ranks of a Cluster over one medium)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast.device.streams import CellStreams
from gpipe_fast.distributed.shm_links import ENV
from gpipe_fast.transport.local import LocalTransport
from gpipe_fast.transport.processes.across import ProcessTransport
from gpipe_fast.transport.protocol import ACTIVATION, GRADIENT, Flow, Transport

# Every method of the protocol, read from it: a method added there is uncovered until the
# scenario calls it.
PROTOCOL = sorted(
    name
    for name, _ in inspect.getmembers(Transport, inspect.isfunction)
    if not name.startswith("_")
)
SKIP: Hashable = (None, "far")
# GPIPE_FAST_TRANSPORT's value that makes a pipe of two ranks on this host take each medium.
MEDIA = {"shared memory": "", "gloo": "gloo"}


class Recording:
    """A transport seen through the protocol: records which of its methods were called."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.called: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        if name in PROTOCOL:
            self.called.add(name)
        return getattr(self.inner, name)


def _values(flow: Flow, microbatch: int) -> tuple[Any, torch.Tensor]:
    """A payload of `flow` for `microbatch` and a skip's value, the same on every rank: fresh
    random float64, the first tensor a transposed view; micro-batch 1's too large to travel
    inside its header."""
    g = torch.Generator().manual_seed(100 * microbatch + (0 if flow == ACTIVATION else 1))
    rows = 3 if microbatch == 0 else 80
    big = torch.randn(64, rows, generator=g, dtype=torch.float64).t()
    skip = torch.randn(rows, 5, generator=g, dtype=torch.float64)
    if flow == ACTIVATION:  # a pytree with a non-tensor leaf
        return (big, {"n": microbatch, "t": torch.arange(4) + microbatch}), skip
    return (big, None), skip


def _same(got: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and not got.requires_grad
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    elif isinstance(expected, (tuple, list)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            _same(g, e)
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for k in expected:
            _same(got[k], expected[k])
    else:
        assert got == expected


def _send(
    t: Any, flow: Flow, stage: int, receiver: int, m: int, values: Any, skip: torch.Tensor
) -> None:
    """`stage`'s side of a hand-over to `receiver`: its own input delivered and received, then
    `values` and the skip sent, as the communication tasks post them."""
    t.deliver(flow, stage, m, values[0])
    _same(t.recv(flow, stage, m), values[0])
    t.send(flow, stage, m, values)
    t.send_skip(flow, stage, receiver, m, SKIP, skip)
    t.post(flow, stage, m)
    t.post_skips(flow, stage, m)


def _receive(t: Any, flow: Flow, stage: int, m: int, values: Any, skip: torch.Tensor) -> None:
    """`stage`'s side: the values and the skip fetched, received and checked."""
    t.fetch(flow, stage, m)
    t.fetch_skips(flow, stage, m)
    _same(t.recv(flow, stage, m), values)
    _same(t.recv_skip(flow, stage, m, SKIP), skip)


def exercise(transport: Transport, local: Callable[[int], bool]) -> list[str]:
    """Two micro-batches forward and back between cells 0 and 1 (each step run by the process
    of its cell: `local`), with a skip from cell 0 to cell 1, the communication tasks run as
    for cells of two processes; then a failed step's values discarded. Checks every value
    received; returns the protocol's methods it called."""
    t = Recording(transport)
    # Micro-batch 0's receives posted ahead (where the medium does), micro-batch 1's not.
    t.expect([key for key in ((ACTIVATION, 1, 0), (GRADIENT, 0, 0)) if local(key[1])])
    for m in (0, 1):
        payload, skip = _values(ACTIVATION, m)
        grads, skip_grad = _values(GRADIENT, m)
        if local(0):
            _send(t, ACTIVATION, 0, 1, m, payload, skip)
        if local(1):
            _receive(t, ACTIVATION, 1, m, payload, skip)
            _send(t, GRADIENT, 1, 0, m, grads, skip_grad)
        if local(0):
            _receive(t, GRADIENT, 0, m, grads, skip_grad)
    t.finish()
    assert t.pending() == 0
    # A failed step: what was sent and never received is forgotten.
    for stage, flow, receiver in ((0, ACTIVATION, 1), (1, GRADIENT, 0)):
        if local(stage):
            before = t.pending()
            payload, skip = _values(flow, 0)
            t.send(flow, stage, 5, payload)
            t.send_skip(flow, stage, receiver, 5, SKIP, skip)
            assert t.pending() == before + 2
            t.discard()
            assert t.pending() == 0
    return sorted(t.called)


def in_process() -> list[str]:
    """The scenario over the in-process transport, both cells here."""
    devices = [torch.device("cpu")] * 2
    transport = LocalTransport(CellStreams(devices, [0, 1]), devices)
    return exercise(transport, lambda stage: True)


def over_medium(rank: int, world: int, *, medium: str) -> dict[str, Any]:
    """The scenario over the transport across the two ranks of a pipe whose messages take
    `medium` (a cell per rank), made as a step's transport is, with a skip pair between them."""
    import torch.distributed as dist

    saved = os.environ.get(ENV)
    os.environ[ENV] = MEDIA[medium]
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).double()
        pipe = gf.GPipe(model, [1, 1], chunks=2, pp_group=dist.group.WORLD, timeout=60)
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved
    try:
        pipeline = pipe._pipeline
        assert pipeline is not None and pipeline.groups is not None
        layout, guard = pipeline.layout, pipeline.groups.guard
        local = LocalTransport(pipeline.streams, pipeline.devices)
        media = pipeline.media.step_media(layout, guard, torch.device("cpu"))
        transport = ProcessTransport(local, layout, media, {(0, 1): [SKIP]})
        called = exercise(transport, layout.is_local)
        return {"kind": pipe.transport_kind, "called": called}
    finally:
        pipe.close()

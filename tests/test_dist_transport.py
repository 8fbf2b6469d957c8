"""The transport between processes: the same steps over shared memory and over gloo, bit for
bit, for every schedule and checkpoint mode, with skips and non-contiguous tensors both ways."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transport_cases
from cluster import Cluster, values
from torch import nn

from gpipe_fast import _C
from gpipe_fast.transport import wire

SEED = 11
BATCHES = [7, 12]  # uneven, then even micro-batches (chunks=3)
# Stages per worker of each schedule (0: any number; the test gives such a schedule two).
KINDS = {
    kind.name: kind.stages_per_worker or 2 for kind in _C.schedule_kinds() if not kind.registered
}


def _reference(batches: list[int]) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """The plain model on each whole batch, SGD between: (loss, gradients by name)."""
    net = transport_cases.strided_model(SEED)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    steps = []
    for step, size in enumerate(batches):
        x, y = transport_cases.batch(size, step)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        steps.append((loss.item(), {n: p.grad.clone() for n, p in net.named_parameters()}))
        optimizer.step()
    return steps


@pytest.mark.parametrize("schedule", list(KINDS))
def test_shared_memory_and_gloo_give_the_same_steps_bit_for_bit(
    two: Cluster, schedule: str
) -> None:
    balance = [4, 4] if KINDS[schedule] == 1 else [2, 2, 2, 2]
    results = values(two.run("transport_cases.both_transports", schedule=schedule,
                             balance=balance, batches=BATCHES, seed=SEED))  # fmt: skip
    assert all(r["poisoned"] for r in results), "the suite's rings run poisoned"
    reference = _reference(BATCHES)
    for checkpoint in transport_cases.CHECKPOINTS:
        shm = [r["runs"][f"{checkpoint} shared memory"] for r in results]
        gloo = [r["runs"][f"{checkpoint} gloo"] for r in results]
        assert shm == gloo, f"{checkpoint}: shared memory and gloo differ"
        for step, (loss, grads) in enumerate(reference):
            seen: set[str] = set()
            for rank, run in enumerate(shm):
                got = run["steps"][step]
                assert got["loss"] == pytest.approx(loss, rel=1e-12), (checkpoint, rank, step)
                for name, grad in got["grads"].items():
                    torch.testing.assert_close(
                        torch.tensor(grad, dtype=torch.float64), grads[name], rtol=1e-10,
                        atol=1e-13, msg=f"{checkpoint}, rank {rank}, step {step}, {name}",
                    )  # fmt: skip
                    seen.add(name)
            assert seen == set(grads), (checkpoint, step)


def _read(parts: list[tuple[int, int]]) -> list[bytes]:
    """The bytes at each (address, size) part, read as the native ring reads them."""
    import ctypes

    return [ctypes.string_at(address, size) for address, size in parts]


def test_a_gathered_message_owns_the_copies_its_parts_point_at() -> None:
    # A transposed tensor is sent as a contiguous copy that nothing else holds: the gathered
    # message keeps it, so its bytes are still there when the ring copies them.
    source = torch.randn(64, 3, dtype=torch.float64)
    payload: Any = (source.t(), None, torch.arange(5))
    message = wire.gather(payload)
    expected = [t.contiguous().numpy().tobytes() for t in (source.t(), torch.arange(5))]
    del payload
    for _ in range(3):  # allocations that would reuse a freed copy's memory
        torch.randn(64, 3, dtype=torch.float64).t().contiguous()
    assert _read(message.parts)[1:] == expected
    assert len(message.owners) == len(message.parts)

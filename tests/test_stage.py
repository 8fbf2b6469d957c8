"""A stage's actions: forward, loss and backward leave the unpartitioned module's gradients."""

from __future__ import annotations

import torch
from test_step import _owner
from torch import nn

from gpipe_fast.runtime.step import Step


def test_forward_loss_backward_on_every_stage_match_the_unpartitioned_module() -> None:
    owner = _owner()
    cells = [c for c in owner.cells if c is not None]
    whole = nn.Sequential(*[c.module for c in cells])
    x, target = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    expected = nn.functional.mse_loss(whole(x), target)
    expected.backward()
    wanted = [p.grad.clone() for p in whole.parameters()]  # type: ignore[union-attr]
    whole.zero_grad()

    step = Step(owner, [x[:2], x[2:]], [False], [[False, False]] * 2, True,
                transport=owner.transport())  # fmt: skip
    step.context.set_loss(nn.functional.mse_loss, [target[:2], target[2:]], [0.5, 0.5])
    first, last = step.stages
    assert first is not None and last is not None
    for m in range(2):
        first.forward(m)
        last.forward(m)
        last.loss(m)
        last.backward(m)
        first.backward(m)
    loss = sum(step.context.losses)  # type: ignore[arg-type]
    torch.testing.assert_close(loss, expected)
    for p, g in zip(whole.parameters(), wanted, strict=True):
        torch.testing.assert_close(p.grad, g)
    assert first.inputs == [None, None] and last.outputs == [None, None]  # buffers freed


def test_recompute_rebuilds_a_checkpointed_output() -> None:
    owner = _owner()
    x = torch.randn(2, 3, dtype=torch.float64)
    step = Step(owner, [x], [False], [[True]] * 2, True, transport=owner.transport())
    stage = step.stages[0]
    assert stage is not None
    stage.forward(0)
    assert stage.outputs[0] is None  # checkpointed: no graph kept
    stage.recompute(0)
    assert stage.outputs[0] is not None and stage.outputs[0].requires_grad  # type: ignore[union-attr]

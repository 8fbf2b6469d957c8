"""The autograd bridge: loss.backward() on pipe(x)'s output drives the pipelined backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn


def test_backward_through_the_bridge_matches_the_unpartitioned_module(make_pipe: Any) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    module(x_ref).pow(2).sum().backward()
    wanted = [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]
    module.zero_grad()
    pipe = make_pipe(module, [2, 1], devices=["cpu"] * 2, chunks=2)
    pipe(x).pow(2).sum().backward()
    for p, g in zip(module.parameters(), wanted, strict=True):
        torch.testing.assert_close(p.grad, g)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_a_second_backward_through_one_output_is_refused(make_pipe: Any) -> None:
    module = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).double()
    pipe = make_pipe(module, [1, 1], devices=["cpu"] * 2, chunks=2)
    out = pipe(torch.randn(4, 3, dtype=torch.float64)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        out.backward()

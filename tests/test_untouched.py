"""planning/untouched.py: what a tuning's steps find is what they leave."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_fast.planning.untouched import untouched


def test_gradients_buffers_generators_and_threads_come_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(8, 4, requires_grad=True)
    model(x).sum().backward()
    grads = [p.grad for p in model.parameters()]
    values = [g.clone() for g in grads]  # type: ignore[union-attr]
    stats = [b.clone() for b in model.buffers()]
    input_grad = x.grad
    generator = torch.get_rng_state()
    threads = torch.get_num_threads()

    with untouched([model], [x]):
        assert all(p.grad is None for p in model.parameters())
        assert x.grad is None
        model(x).sum().backward()  # a step: gradients, statistics, the input's gradient move
        torch.randn(3)
        torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)

    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(g, v) for g, v in zip(grads, values, strict=True))  # type: ignore[arg-type]
    assert all(torch.equal(b, s) for b, s in zip(model.buffers(), stats, strict=True))
    assert x.grad is input_grad
    assert torch.equal(torch.get_rng_state(), generator)
    assert torch.get_num_threads() == threads


def test_an_error_inside_still_gives_everything_back() -> None:
    model = nn.Linear(2, 2)
    model(torch.randn(3, 2)).sum().backward()
    grad = model.weight.grad
    with pytest.raises(RuntimeError, match="inside"), untouched([model], []):
        raise RuntimeError("inside")
    assert model.weight.grad is grad

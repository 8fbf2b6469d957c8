"""gf.GradScaler and train_step(grad_scaler=) in one process (the ranks' agreement is in
tests/test_multiprocess.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def test_the_loss_gradients_are_scaled_and_the_loss_is_not(make_pipe: Any) -> None:
    plain = _model()
    pipe = make_pipe(copy.deepcopy(plain), [2, 3], chunks=3, schedule="1f1b")
    scaler = gf.GradScaler(pipe, init_scale=1024.0)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == 1024.0
    x, y = torch.randn(9, 6), torch.randn(9, 2)
    want = nn.functional.mse_loss(plain(x), y)
    want.backward()
    loss = pipe.train_step(x, y, nn.functional.mse_loss, grad_scaler=scaler)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)  # unscaled
    for (name, p), q in zip(plain.named_parameters(), pipe.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad * 1024, rtol=1e-5, atol=1e-6, msg=name)


def test_a_step_with_the_scaler_is_the_plain_step(make_pipe: Any) -> None:
    plain = _model()
    pipe = make_pipe(copy.deepcopy(plain), [2, 3], chunks=2)
    scaler = gf.GradScaler(pipe, init_scale=256.0, growth_interval=1)
    opt, plain_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, plain))
    for _ in range(3):
        x, y = torch.randn(8, 6), torch.randn(8, 2)
        opt.zero_grad()
        plain_opt.zero_grad()
        pipe.train_step(x, y, nn.functional.mse_loss, grad_scaler=scaler)
        scaler.step(opt)
        scaler.update()
        nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()
    for p, q in zip(plain.parameters(), pipe.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert scaler.get_scale() == 256.0 * 2**3  # grew every step: no overflow


def test_an_inf_gradient_skips_the_step_and_lowers_the_scale(make_pipe: Any) -> None:
    pipe = make_pipe(_model(), [2, 3], chunks=2)
    scaler = gf.GradScaler(pipe, init_scale=64.0)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.train_step(torch.randn(4, 6), torch.randn(4, 2), nn.functional.mse_loss,
                    grad_scaler=scaler)  # fmt: skip
    before = [p.detach().clone() for p in pipe.parameters()]
    next(pipe.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(pipe.parameters(), before, strict=True))
    assert scaler.get_scale() == 32.0


def test_a_disabled_scaler_changes_nothing(make_pipe: Any) -> None:
    plain = _model()
    pipe = make_pipe(copy.deepcopy(plain), [2, 3], chunks=2)
    x, y = torch.randn(4, 6), torch.randn(4, 2)
    pipe.train_step(x, y, nn.functional.mse_loss, grad_scaler=gf.GradScaler(pipe, enabled=False))
    nn.functional.mse_loss(plain(x), y).backward()
    for p, q in zip(plain.parameters(), pipe.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)


def test_grad_scaler_must_be_a_scaler(make_pipe: Any) -> None:
    pipe = make_pipe(_model(), [2, 3])
    with pytest.raises(TypeError, match=r"grad_scaler must be a gpipe_fast\.GradScaler"):
        pipe.train_step(torch.randn(2, 6), torch.randn(2, 2), nn.functional.mse_loss,
                        grad_scaler=1024.0)  # fmt: skip

"""The runner: its phases run a step's schedule on the executor, and record when asked."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpipe_fast.api.gpipe import pipeline_of


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def test_train_step_through_the_runner_matches_the_unpartitioned_module(make_pipe: Any) -> None:
    module = _model()
    x, target = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    reference = nn.functional.mse_loss(module(x), target)
    reference.backward()
    wanted = [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]
    module.zero_grad()
    pipe = make_pipe(module, [2, 1], devices=["cpu"] * 2, chunks=3, schedule="1f1b")
    loss = pipe.train_step(x, target, nn.functional.mse_loss)
    torch.testing.assert_close(loss, reference.detach())
    for p, g in zip(module.parameters(), wanted, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_the_runner_records_only_while_recording(make_pipe: Any) -> None:
    pipe = make_pipe(_model(), [2, 1], devices=["cpu"] * 2, chunks=2)
    runner = pipeline_of(pipe).runner  # type: ignore[union-attr]
    x = torch.randn(4, 3, dtype=torch.float64)
    pipe(x).sum().backward()
    assert runner.recorded is None
    pipe.record_timeline()
    pipe(x).sum().backward()
    assert runner.recording and set(runner.recorded) == {"forward", "backward"}
    pipe.record_timeline(False)
    assert runner.recorded is None


def test_a_failed_run_discards_deferred_batch_norm_statistics(make_pipe: Any) -> None:
    module = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1)).double()
    pipe = make_pipe(module, [2, 1], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
    before = module[1].running_mean.clone()

    def fails(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ValueError("no loss")

    x = torch.randn(4, 3, dtype=torch.float64)
    try:
        pipe.train_step(x, x, fails)
    except ValueError:
        pass
    torch.testing.assert_close(pipe[1].running_mean, before)

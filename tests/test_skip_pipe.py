"""Skippable layers inside gf.GPipe: skips within a cell and across cells, on every schedule
and checkpoint mode, through train_step and through pipe(x) + loss.backward()."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from skip_models import (
    BALANCES,
    SCENARIOS,
    WIDTH,
    Down,
    DropDown,
    DropUp,
    Up,
    linear,
    unet,
)
from torch import nn

import gpipe_fast as gf
from gpipe_fast.skip import pop, skippable, stash, verify_skippables

from helpers import assert_same_run, pipe_run, reference_run

SCHEDULES = gf.builtin_schedules()
MODES = ("never", "except_last", "always")


def _cases() -> list[Any]:
    cases = []
    for schedule in SCHEDULES:
        for cells in (2, 3, 4):
            if schedule in ("interleaved", "zbv") and cells % 2:
                continue  # two cells per device
            cases.append(pytest.param(schedule, cells, id=f"{schedule}-K{cells}"))
    return cases


def _pipe(make_pipe: Any, model: nn.Sequential, cells: int, schedule: str, **kw: Any) -> gf.GPipe:
    devices = ["cpu"] * (cells // 2 if schedule in ("interleaved", "zbv") else cells)
    return make_pipe(model, BALANCES[cells], devices=devices, schedule=schedule, **kw)  # type: ignore[no-any-return]


def _reference_step(
    model: nn.Sequential, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    ref = copy.deepcopy(model)
    x = x.detach().clone().requires_grad_()
    loss = nn.functional.mse_loss(ref(x), y)
    loss.backward()
    assert x.grad is not None
    return loss.detach(), x.grad, [p.grad.clone() for p in ref.parameters()]  # type: ignore[union-attr]


def _train_step(
    pipe: gf.GPipe, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    assert x.grad is not None
    return loss, x.grad, [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(("schedule", "cells"), _cases())
def test_skips_equal_the_plain_sequential(
    make_pipe: Any, schedule: str, cells: int, checkpoint: str, scenario: str
) -> None:
    torch.manual_seed(len(scenario) * 10 + cells)
    model = SCENARIOS[scenario]().double()
    verify_skippables(model)
    pipe = _pipe(make_pipe, model, cells, schedule, chunks=3, checkpoint=checkpoint)
    for batch in (7, 12):  # uneven, then even micro-batches; fresh inputs each time
        x = torch.randn(batch, WIDTH, dtype=torch.float64)
        y = torch.randn(batch, WIDTH, dtype=torch.float64)
        assert_same_run(_train_step(pipe, model, x, y), _reference_step(model, x, y))
        assert_same_run(pipe_run(pipe, model, x), reference_run(model, x))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("batch", "chunks"), [(11, 4), (3, 5)])  # uneven, N < M
def test_uneven_and_short_batches(make_pipe: Any, schedule: str, batch: int, chunks: int) -> None:
    model = SCENARIOS["multi"]().double()
    pipe = _pipe(make_pipe, model, 4, schedule, chunks=chunks, checkpoint="except_last")
    x = torch.randn(batch, WIDTH, dtype=torch.float64)
    y = torch.randn(batch, WIDTH, dtype=torch.float64)
    assert_same_run(_train_step(pipe, model, x, y), _reference_step(model, x, y))
    assert_same_run(pipe_run(pipe, model, x), reference_run(model, x))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[5], [2, 3], [1, 3, 1], [1, 1, 1, 2]])
def test_unet_in_a_pipe(make_pipe: Any, balance: list[int], checkpoint: str) -> None:
    module = unet(2).double()  # Down Down Linear Up Up: nested skips
    x = torch.randn(7, WIDTH, dtype=torch.float64)
    want = reference_run(module, x)
    pipe = make_pipe(
        module, balance, devices=["cpu"] * len(balance), chunks=3, checkpoint=checkpoint
    )
    assert_same_run(pipe_run(pipe, module, x), want)


def test_dropout_in_a_stashing_layer_is_replayed(make_pipe: Any) -> None:
    # Each (step, cell, micro-batch) draws from its own generator: a recomputation replays
    # the stashed dropout mask, and every schedule and mode computes the same step.
    torch.manual_seed(0)
    model = nn.Sequential(linear(), DropDown(), nn.Tanh(), linear(), DropUp(), linear()).double()
    x = torch.randn(9, WIDTH, dtype=torch.float64)
    y = torch.randn(9, WIDTH, dtype=torch.float64)
    results = {}
    for schedule in SCHEDULES:
        for checkpoint in MODES:
            pipe = _pipe(make_pipe, model, 4, schedule, chunks=3, checkpoint=checkpoint)
            torch.manual_seed(1234)
            results[schedule, checkpoint] = _train_step(pipe, model, x, y)
    first = results["gpipe", "never"]
    for key, got in results.items():
        torch.testing.assert_close(got[0], first[0], rtol=1e-10, atol=1e-12, msg=str(key))
        assert_same_run(got, first)
    # Dropout did drop: not the evaluation's loss.
    assert not torch.allclose(first[0], nn.functional.mse_loss(copy.deepcopy(model).eval()(x), y))


LIVE: list[weakref.ref[torch.Tensor]] = []


@skippable(stash=["held"])
class _TrackedStash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = torch.sin(self.lin(x))
        LIVE.append(weakref.ref(skip))
        yield stash("held", skip)
        return x * 3


@skippable(pop=["held"])
class _TrackedPop(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("held")
        LIVE.append(weakref.ref(skip))  # the leaf the pipe received for this cell
        return x * skip


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_no_skip_tensor_is_held_after_a_step(
    make_pipe: Any, schedule: str, checkpoint: str
) -> None:
    model = nn.Sequential(
        _TrackedStash(), linear(), linear(), linear(), _TrackedPop(), linear()
    ).double()
    pipe = _pipe(make_pipe, model, 4, schedule, chunks=3, checkpoint=checkpoint)
    x = torch.randn(6, WIDTH, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, WIDTH, dtype=torch.float64)
    LIVE.clear()
    pipe.train_step(x, y, nn.functional.mse_loss)
    gc.collect()
    assert LIVE and not [ref for ref in LIVE if ref() is not None]
    LIVE.clear()
    out = pipe(x)
    out.sum().backward()  # `out` (and its graph's step) stays alive: the skips must not
    gc.collect()
    assert LIVE and not [ref for ref in LIVE if ref() is not None]
    LIVE.clear()


def test_a_pipe_verifies_its_skippable_layers(make_pipe: Any) -> None:
    with pytest.raises(TypeError, match="'1' declared 'down' as poppable but it was not stashed"):
        make_pipe(nn.Sequential(linear(), Up()), [1, 1], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="no module declared 'down' as poppable but stashed"):
        make_pipe(nn.Sequential(Down(), linear()), [1, 1], devices=["cpu", "cpu"])


def test_skips_inside_cells_keep_working_in_eval_mode(make_pipe: Any) -> None:
    model = SCENARIOS["multi"]().double()
    pipe = _pipe(make_pipe, model, 3, "1f1b", chunks=2)
    x = torch.randn(5, WIDTH, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
    y = torch.randn(5, WIDTH, dtype=torch.float64)
    loss = pipe.eval_step(x, y, nn.functional.mse_loss)
    with torch.no_grad():
        torch.testing.assert_close(loss, nn.functional.mse_loss(model(x), y))

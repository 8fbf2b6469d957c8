"""eval_step in one process: the whole batch's loss from a forward-only run on every schedule,
with no gradient written, no graph recorded, the user's mode and autocast kept; and
train_step under no_grad refused (the processes' side is in test_multiprocess.py)."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf

from helpers import mlp

SCHEDULES = gf.builtin_schedules()
MODES = ("never", "except_last", "always")
_model = partial(mlp, width=5)  # Linear+Tanh layers (and Dropout when asked), float64


def _pipe(make_pipe: Any, model: nn.Sequential, schedule: str, **kwargs: Any) -> gf.GPipe:
    """Four cells; interleaved and zbv run them on two workers (two cells each)."""
    devices = ["cpu"] * (2 if schedule in ("interleaved", "zbv") else 4)
    per = len(model) // 4
    return make_pipe(model, [per] * 4, devices=devices, schedule=schedule, **kwargs)  # type: ignore[no-any-return]


def _data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 5, dtype=torch.float64), torch.randn(batch, 5, dtype=torch.float64)


def _plain_loss(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: Any) -> Any:
    with torch.no_grad():
        return loss_fn(copy.deepcopy(model)(x), y)


def _graph_watch(model: nn.Sequential) -> list[bool]:
    """Per layer call: whether its output records a graph (it must not)."""
    seen: list[bool] = []
    for layer in model:
        layer.register_forward_hook(lambda _m, _i, out: seen.append(out.requires_grad))
    return seen


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(("batch", "chunks"), [(12, 4), (11, 4), (3, 5)])  # even, uneven, N < M
def test_loss_equals_the_whole_batch_and_nothing_learns(
    make_pipe: Any, schedule: str, checkpoint: str, batch: int, chunks: int
) -> None:
    model = _model(4)
    x, y = _data(batch)
    x.requires_grad_()
    want = _plain_loss(model, x, y, nn.functional.mse_loss)
    pipe = _pipe(make_pipe, model, schedule, chunks=chunks, checkpoint=checkpoint)
    seen = _graph_watch(model)
    loss = pipe.eval_step(x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-15)
    assert loss.grad_fn is None and not loss.requires_grad
    assert len(seen) == len(model) * min(batch, chunks)  # each layer on each micro-batch
    assert not any(seen), "a layer recorded a graph"
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    assert pipe.memory_stats()[0]["stash_bytes"] == 0  # no activation kept for a backward


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_of_a_train_step_stay_as_they_were(make_pipe: Any, schedule: str) -> None:
    model = _model(4)
    x, y = _data(10)
    pipe = _pipe(make_pipe, model, schedule, chunks=3)
    pipe.train_step(x, y, nn.functional.mse_loss)
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    x2, y2 = _data(7)
    torch.testing.assert_close(
        pipe.eval_step(x2, y2, nn.functional.mse_loss),
        _plain_loss(model, x2, y2, nn.functional.mse_loss),
    )
    for p, grad in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, grad)  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sum_reduction_adds_microbatch_losses(make_pipe: Any, schedule: str) -> None:
    model = _model(4)
    x, y = _data(10)

    def summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target, reduction="sum")

    pipe = _pipe(make_pipe, model, schedule, chunks=3)
    torch.testing.assert_close(
        pipe.eval_step(x, y, summed, reduction="sum"), _plain_loss(model, x, y, summed)
    )


def test_the_loss_function_runs_without_grad_on_the_plain_output(make_pipe: Any) -> None:
    model = _model(4)
    x, y = _data(9)
    calls: list[tuple[bool, bool]] = []

    def watched(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append((torch.is_grad_enabled(), out.requires_grad))
        return nn.functional.mse_loss(out, target)

    pipe = _pipe(make_pipe, model, "1f1b", chunks=3)
    pipe.eval_step(x, y, watched)
    assert calls == [(False, False)] * 3  # once per micro-batch, nothing to differentiate


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dropout_follows_the_mode_the_user_set(make_pipe: Any, schedule: str) -> None:
    model = _model(4, dropout=0.5)
    x, y = _data(12)
    pipe = _pipe(make_pipe, model, schedule, chunks=4, checkpoint="always")
    # train(): dropout is active, with the masks train_step draws from the same seed.
    torch.manual_seed(7)
    training = pipe.eval_step(x, y, nn.functional.mse_loss)
    assert pipe.training and all(layer.training for layer in model)
    torch.manual_seed(7)
    torch.testing.assert_close(training, pipe.train_step(x, y, nn.functional.mse_loss))
    # eval(): dropout is off, the plain model's loss.
    plain = _plain_loss(model.eval(), x, y, nn.functional.mse_loss)
    assert not torch.allclose(training, plain)
    pipe.eval()
    torch.testing.assert_close(pipe.eval_step(x, y, nn.functional.mse_loss), plain)
    assert not pipe.training


def test_runs_under_the_callers_autocast(make_pipe: Any) -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    dtypes: list[torch.dtype] = []

    def watched(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        dtypes.append(out.dtype)
        return nn.functional.mse_loss(out.float(), target)

    pipe = make_pipe(model, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.eval_step(x, y, watched)
        want = _plain_loss(model, x, y, watched)
    assert dtypes == [torch.bfloat16] * 3  # two micro-batches, then the plain model
    torch.testing.assert_close(loss, want, rtol=2e-2, atol=1e-3)


def test_tuple_inputs(make_pipe: Any) -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> Any:
            a, b = pair
            return torch.tanh(self.linear(a)) + b, b * 0.5

    def pair_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return ((out[0] - y) ** 2).mean() + out[1].pow(2).mean()

    model = nn.Sequential(*[Pair() for _ in range(4)]).double()
    a, b, y = (torch.randn(9, 4, dtype=torch.float64) for _ in range(3))
    pipe = _pipe(make_pipe, model, "zero_bubble", chunks=3)
    torch.testing.assert_close(
        pipe.eval_step((a, b), y, pair_loss), _plain_loss(model, (a, b), y, pair_loss)
    )


def test_train_step_under_no_grad_raises_and_runs_nothing(make_pipe: Any) -> None:
    model = _model(4)
    x, y = _data(8)
    pipe = _pipe(make_pipe, model, "1f1b", chunks=2)
    calls: list[int] = []
    model[0].register_forward_hook(lambda *_: calls.append(1))
    for context in (torch.no_grad, torch.inference_mode):
        with context(), pytest.raises(RuntimeError, match=r"pipe\.eval_step"):
            pipe.train_step(x, y, nn.functional.mse_loss)
    assert not calls and all(p.grad is None for p in model.parameters())
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"pipe\.eval_step"):
        make_pipe(nn.Sequential(), []).train_step(x, y, nn.functional.mse_loss)


def test_pipe_under_no_grad_still_gives_the_output(make_pipe: Any) -> None:
    model = _model(4)
    x, _ = _data(7)
    pipe = _pipe(make_pipe, model, "interleaved", chunks=3)
    with torch.no_grad():
        out = pipe(x)
        want = copy.deepcopy(model)(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-15)


def test_an_eval_step_is_recorded_as_forwards_and_losses(make_pipe: Any) -> None:
    pipe = _pipe(make_pipe, _model(4), "zero_bubble", chunks=3, checkpoint="always")
    pipe.record_timeline()
    pipe.eval_step(*_data(6), nn.functional.mse_loss)
    kinds = [span.kind for span in pipe.timeline().spans]
    assert sorted(set(kinds)) == ["forward", "loss"]
    assert kinds.count("forward") == 4 * 3 and kinds.count("loss") == 3


def test_an_empty_pipe_gives_the_loss_of_the_input(make_pipe: Any) -> None:
    x, y = _data(5)
    x.requires_grad_()
    loss = make_pipe(nn.Sequential(), []).eval_step(x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, nn.functional.mse_loss(x, y).detach())
    assert not loss.requires_grad and x.grad is None


def test_bad_arguments_are_named(make_pipe: Any) -> None:
    model = _model(4)
    pipe = _pipe(make_pipe, model, "gpipe", chunks=2)
    x, y = _data(4)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pipe.eval_step(x, y, "mse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction must be one of"):
        pipe.eval_step(x, y, nn.functional.mse_loss, reduction="max")
    with pytest.raises(ValueError, match="target has batch size 3"):
        pipe.eval_step(x, y[:3], nn.functional.mse_loss)
    with pytest.raises(TypeError, match="loss_fn must return a scalar"):
        pipe.eval_step(x, y, lambda out, target: out - target)
    # The pipe stays usable after each.
    torch.testing.assert_close(
        pipe.eval_step(x, y, nn.functional.mse_loss),
        _plain_loss(model, x, y, nn.functional.mse_loss),
    )

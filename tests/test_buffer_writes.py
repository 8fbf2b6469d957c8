"""Buffers a forward writes: a recompute replays the forward from the values they had then,
and writes none again, so the pipe equals the model run micro-batch by micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations

from gpipe_fast.nn.buffer_writes import BufferWrites
from gpipe_fast.nn.microbatch import split_sizes

MODES = ["except_last", "never", "always"]


class Running(nn.Module):
    """A layer with state of its own, written in forward in three ways: a running mean
    updated in place (and used: the output depends on its value before the update), a call
    counter replaced by a new tensor, and a last-seen norm written through .data."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("norm", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x - self.mean)
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.5).add_(x.mean(0), alpha=0.5)
            self.calls = self.calls + 1
            self.norm.data.copy_(x.detach().norm())
        return out


def spectral(kind: str) -> nn.Module:
    layer = nn.Linear(8, 8)
    if kind == "parametrization":
        return parametrizations.spectral_norm(layer)
    return nn.utils.spectral_norm(layer)  # the older hook-based form: weight_u, weight_v


def _model(middle: Callable[[], nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), middle(), nn.Tanh(), nn.Linear(8, 2)).double()


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    return x, torch.randn(8, 2, generator=generator, dtype=torch.float64)


def _accumulated(model: nn.Module, x: Tensor, y: Tensor, chunks: int) -> Tensor:
    """The plain model micro-batch by micro-batch (as gradient accumulation runs it), each
    mean-squared loss weighted by its rows: what a pipe of `chunks` micro-batches computes."""
    total = torch.zeros((), dtype=x.dtype)
    sizes = split_sizes(len(x), chunks)
    for xm, ym in zip(x.split(sizes), y.split(sizes), strict=True):
        loss = F.mse_loss(model(xm), ym) * (len(xm) / len(x))
        loss.backward()
        total += loss.detach()
    return total


def _same_state(got: nn.Module, want: nn.Module) -> None:
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13, msg=name)
    for (name, a), (_, b) in zip(got.named_buffers(), want.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("kind", ["parametrization", "hooks"])
def test_spectral_norm_matches_the_model_without_the_pipe(
    make_pipe: Any, kind: str, chunks: int, schedule: str, checkpoint: str
) -> None:
    # Its power iteration updates _u and _v in forward; a recompute running it again would
    # give backward another weight than forward's. One micro-batch: the plain model on the
    # batch; four: the plain model on the four in turn.
    x, y = _batch()
    plain = _model(lambda: spectral(kind))
    want = _accumulated(plain, x, y, chunks)
    model = _model(lambda: spectral(kind))
    pipe = make_pipe(model, [2, 3], devices=["cpu"] * 2, chunks=chunks, checkpoint=checkpoint,
                     schedule=schedule)  # fmt: skip
    loss = pipe.train_step(x, y, F.mse_loss)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    _same_state(model, plain)


@pytest.mark.parametrize("checkpoint", MODES)
def test_a_layers_own_buffers_are_written_once_per_micro_batch(
    make_pipe: Any, checkpoint: str
) -> None:
    x, y = _batch()
    plain = _model(lambda: Running(8))
    want = _accumulated(plain, x, y, 4)
    model = _model(lambda: Running(8))
    pipe = make_pipe(model, [2, 3], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)
    for _ in range(2):  # the second step replays from what the first learned
        loss = pipe.train_step(x, y, F.mse_loss)
    want = _accumulated(plain, x, y, 4)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    _same_state(model, plain)
    assert model[2].calls.item() == 8


def test_the_pipe_call_replays_them_too(make_pipe: Any) -> None:
    x, y = _batch()
    plain = _model(lambda: spectral("parametrization"))
    _accumulated(plain, x, y, 2)
    model = _model(lambda: spectral("parametrization"))
    pipe = make_pipe(model, [2, 3], devices=["cpu"] * 2, chunks=2, checkpoint="always")
    sizes = split_sizes(len(x), 2)
    out = pipe(x).split(sizes)
    loss = sum(F.mse_loss(o, t) * (len(o) / len(x)) for o, t in zip(out, y.split(sizes),
                                                                     strict=True))  # fmt: skip
    loss.backward()  # type: ignore[union-attr]
    _same_state(model, plain)


def test_a_step_in_eval_mode_teaches_nothing_about_training(make_pipe: Any) -> None:
    # spectral_norm writes nothing in eval: what a cell writes is learned per mode.
    x, y = _batch()
    plain = _model(lambda: spectral("parametrization"))
    model = _model(lambda: spectral("parametrization"))
    pipe = make_pipe(model, [2, 3], devices=["cpu"] * 2, chunks=4, checkpoint="always")
    for training in (False, True):
        model.train(training)
        plain.train(training)
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, F.mse_loss)
        torch.testing.assert_close(loss, _accumulated(plain, x, y, 4), rtol=1e-12, atol=0)
        _same_state(model, plain)


# -- BufferWrites ----------------------------------------------------------------------------


def test_the_written_buffers_are_learned_and_replayed() -> None:
    layer = Running(3).double()
    norm = nn.BatchNorm1d(3).double()
    quiet = nn.Linear(3, 3)
    quiet.register_buffer("constant", torch.ones(3))
    module = nn.Sequential(layer, norm, quiet).double()
    writes = BufferWrites(module, [norm])
    train, evaluate = (True,) * 7, (False,) * 7  # the modes of its 7 modules
    assert writes.may_write(train) and writes.written(train) is None
    x = torch.randn(4, 3, dtype=torch.float64)
    before = {name: b.clone() for name, b in module.named_buffers()}
    saved = writes.save(train)
    first = module(x)
    snapshot = writes.learn(saved)
    assert {name for _, name in writes.written(train) or []} == {"mean", "calls", "norm"}
    assert writes.written(evaluate) is None  # not seen yet
    after = {name: b.clone() for name, b in module.named_buffers()}
    with writes.replaying(snapshot):
        torch.testing.assert_close(layer.mean, before["0.mean"])
        torch.testing.assert_close(module(x), first)  # the forward's computation again
    for name, buffer in module.named_buffers():  # and the buffers as the forward left them
        if not name.startswith("1."):
            torch.testing.assert_close(buffer, after[name], msg=name)


def test_a_module_without_buffers_costs_nothing() -> None:
    writes = BufferWrites(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), [])
    assert not writes.may_write(()) and writes.save(()) is None

"""train_step on every schedule: loss and every gradient equal the whole-batch model's, for each
checkpoint mode and batch shape; determinism across schedules; the in-flight bound."""

from __future__ import annotations

import copy
import threading
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


def _pipe(
    make_pipe: Any, model: nn.Sequential, stages: int, schedule: str, **kwargs: Any
) -> gf.GPipe:
    per = len(model) // stages
    devices = ["cpu"] * (stages // 2 if schedule in ("interleaved", "zbv") else stages)
    return make_pipe(model, [per] * stages, devices=devices, schedule=schedule, **kwargs)  # type: ignore[no-any-return]


def _reference(
    model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: Any
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    ref = copy.deepcopy(model)
    x = x.detach().clone().requires_grad_()
    loss = loss_fn(ref(x), y)
    loss.backward()
    assert x.grad is not None
    return loss.detach(), x.grad, [p.grad.clone() for p in ref.parameters()]  # type: ignore[union-attr]


def _through(
    pipe: gf.GPipe, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: Any, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    loss = pipe.train_step(x, y, loss_fn, **kw)
    assert x.grad is not None
    return loss, x.grad, [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _assert_same(got: Any, want: Any) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)
    for i, (g, w) in enumerate(zip(got[2], want[2], strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"parameter {i}")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(("batch", "chunks"), [(12, 4), (11, 4), (3, 5)])  # even, uneven, N < M
def test_loss_and_gradients_equal_the_whole_batch(
    make_pipe: Any, schedule: str, checkpoint: str, batch: int, chunks: int
) -> None:
    stages = 4
    model = _model(stages)
    x = torch.randn(batch, 5, dtype=torch.float64)
    y = torch.randn(batch, 5, dtype=torch.float64)
    want = _reference(model, x, y, nn.functional.mse_loss)
    pipe = _pipe(make_pipe, model, stages, schedule, chunks=chunks, checkpoint=checkpoint)
    _assert_same(_through(pipe, model, x, y, nn.functional.mse_loss), want)
    # A second step on another batch size reuses the pipe (and its cached schedules).
    x2, y2 = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    _assert_same(
        _through(pipe, model, x2, y2, nn.functional.mse_loss),
        _reference(model, x2, y2, nn.functional.mse_loss),
    )


class _Pair(nn.Module):
    """(a, b) -> (tanh(W a) + b, b): a tuple flowing between stages."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = pair
        return torch.tanh(self.linear(a)) + b, b * 0.5


def _pair_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return ((out[0] - y) ** 2).mean() + out[1].pow(2).mean()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tuple_inputs_and_outputs(make_pipe: Any, schedule: str) -> None:
    model = nn.Sequential(*[_Pair(4) for _ in range(4)]).double()
    a = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(9, 4, dtype=torch.float64)
    ref = copy.deepcopy(model)
    ra, rb = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    want = _pair_loss(ref((ra, rb)), y)
    want.backward()
    pipe = _pipe(make_pipe, model, 4, schedule, chunks=3, checkpoint="except_last")
    loss = pipe.train_step((a, b), y, _pair_loss)
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(a.grad, ra.grad)
    torch.testing.assert_close(b.grad, rb.grad)
    for got, expected in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sum_reduction_adds_microbatch_losses(make_pipe: Any, schedule: str) -> None:
    model = _model(4)
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randn(10, 5, dtype=torch.float64)

    def summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target, reduction="sum")

    want = _reference(model, x, y, summed)
    pipe = _pipe(make_pipe, model, 4, schedule, chunks=3, checkpoint="never")
    _assert_same(_through(pipe, model, x, y, summed, reduction="sum"), want)


def test_dropout_gives_the_same_step_under_every_schedule(make_pipe: Any) -> None:
    model = _model(4, dropout=0.3)
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randn(12, 5, dtype=torch.float64)
    results = {}
    for schedule in SCHEDULES:
        for checkpoint in ("never", "always"):
            torch.manual_seed(99)
            pipe = _pipe(make_pipe, model, 4, schedule, chunks=4, checkpoint=checkpoint)
            results[(schedule, checkpoint)] = _through(pipe, model, x, y, nn.functional.mse_loss)
    first = results[("gpipe", "never")]
    # Dropout really drew masks: the result differs from the eval-mode (no dropout) model.
    assert not torch.equal(first[0], _reference(model.eval(), x, y, nn.functional.mse_loss)[0])
    model.train()
    for key, got in results.items():
        # The same masks: the loss and the input's gradient (one sum per micro-batch) match
        # to the bit; weight gradients add the micro-batches in each schedule's own order.
        assert torch.equal(got[0], first[0]), key
        assert torch.equal(got[1], first[1]), key
        for g, w in zip(got[2], first[2], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15, msg=str(key))


class _Tally:
    """Micro-batches forwarded and not yet backwarded, with the peak."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.peak = 0

    def add(self, n: int) -> None:
        with self.lock:
            self.now += n
            self.peak = max(self.peak, self.now)


class _InFlight(torch.autograd.Function):
    """Counts forwards whose backward has not run yet on every tally of a counter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counter: _Counter) -> torch.Tensor:  # type: ignore[override]
        ctx.counter = counter
        for tally in counter.tallies:
            tally.add(1)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        for tally in ctx.counter.tallies:
            tally.add(-1)
        return grad, None


class _Counter(nn.Module):
    """A stage's in-flight count, also added to its worker's (``shared``) when given."""

    def __init__(self, shared: _Tally | None = None) -> None:
        super().__init__()
        self.own = _Tally()
        self.tallies = [self.own] if shared is None else [self.own, shared]

    @property
    def now(self) -> int:
        return self.own.now

    @property
    def peak(self) -> int:
        return self.own.peak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InFlight.apply(x, self) if torch.is_grad_enabled() else x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_microbatches_in_flight_per_stage(make_pipe: Any, schedule: str) -> None:
    stages, chunks = 4, 8
    counters = [_Counter() for _ in range(stages)]
    layers: list[nn.Module] = []
    for counter in counters:
        layers += [nn.Linear(3, 3), counter]
    model = nn.Sequential(*layers).double()
    pipe = make_pipe(model, [2] * stages, devices=["cpu"] * stages, chunks=chunks,
                     checkpoint="never", schedule=schedule)  # fmt: skip
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    pipe.train_step(x, y, nn.functional.mse_loss)
    peaks = [c.peak for c in counters]
    assert all(c.now == 0 for c in counters)
    if schedule == "gpipe":
        assert peaks == [chunks] * stages
    else:
        assert peaks == [stages - k for k in range(stages)]


@pytest.mark.parametrize(("workers", "per_worker", "chunks"), [(2, 2, 6), (4, 2, 8), (3, 3, 6)])
def test_interleaved_in_flight_matches_megatrons_bound(
    make_pipe: Any, workers: int, per_worker: int, chunks: int
) -> None:
    stages = workers * per_worker
    worker_tallies = [_Tally() for _ in range(workers)]
    counters = [_Counter(worker_tallies[s % workers]) for s in range(stages)]
    layers: list[nn.Module] = []
    for counter in counters:
        layers += [nn.Linear(3, 3), counter]
    model = nn.Sequential(*layers).double()
    pipe = make_pipe(model, [2] * stages, devices=["cpu"] * workers, chunks=chunks,
                     checkpoint="never", schedule="interleaved")  # fmt: skip
    x = torch.randn(2 * chunks, 3, dtype=torch.float64)
    pipe.train_step(x, torch.randn_like(x), nn.functional.mse_loss)
    # Megatron's interleaved 1F1B (M a multiple of D): worker r runs (V-1)*D + 2*(D-1-r)
    # warm-up forwards, then one forward before each backward, so it holds at most one more.
    for r, tally in enumerate(worker_tallies):
        assert tally.now == 0
        assert tally.peak == (per_worker - 1) * workers + 2 * (workers - 1 - r) + 1, r
    assert counters[-1].peak == 1  # the last stage runs each backward right after its forward


def test_pipe_call_and_backward_still_work_on_every_schedule(make_pipe: Any) -> None:
    model = _model(4)
    x = torch.randn(8, 5, dtype=torch.float64)
    want = copy.deepcopy(model)(x)
    for schedule in SCHEDULES:
        pipe = _pipe(make_pipe, model, 4, schedule, chunks=4)
        torch.testing.assert_close(pipe(x), want)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"schedule": "2f2b"}, ValueError, "schedule must be one of"),
        ({"schedule": "interleaved", "balance": [2, 2, 2], "devices": ["cpu"] * 2}, ValueError,
         "balance: the interleaved schedule needs len"),
    ],
)  # fmt: skip
def test_bad_schedule_arguments(
    make_pipe: Any, kwargs: dict[str, Any], error: type, match: str
) -> None:
    args = {"balance": [2, 2], "devices": ["cpu", "cpu"], **kwargs}
    with pytest.raises(error, match=match):
        make_pipe(_model(3 if len(args["balance"]) == 3 else 2), **args)


def test_bad_train_step_arguments(make_pipe: Any) -> None:
    model = _model(2)
    pipe = _pipe(make_pipe, model, 2, "1f1b", chunks=2)
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    with pytest.raises(TypeError, match="loss_fn must return a scalar"):
        pipe.train_step(x, y, lambda out, target: (out - target) ** 2)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pipe.train_step(x, y, "mse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction must be one of"):
        pipe.train_step(x, y, nn.functional.mse_loss, reduction="max")
    with pytest.raises(ValueError, match="target has batch size 3"):
        pipe.train_step(x, y[:3], nn.functional.mse_loss)
    # The pipe still trains after each refusal.
    _assert_same(
        _through(pipe, model, x, y, nn.functional.mse_loss),
        _reference(model, x, y, nn.functional.mse_loss),
    )

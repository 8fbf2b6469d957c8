"""The one step path: a StepRequest run by Pipeline.run on either side gives the plain model's
values, and both sides do everything the StepSide protocol asks (the processes' side of each
program is covered in test_multiprocess.py and test_sharded.py)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gpipe_fast.api.gpipe import pipeline_of
from gpipe_fast.distributed.driver import CrossProcess
from gpipe_fast.runtime.one_process import OneProcess
from gpipe_fast.runtime.step_request import PROGRAMS, StepRequest, StepSide


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()


@pytest.mark.parametrize("side", [OneProcess, CrossProcess])
def test_each_side_has_every_method_of_the_protocol(side: type) -> None:
    methods = {name for name, _ in inspect.getmembers(StepSide, inspect.isfunction)}
    hooks = {"share", "running", "before_step", "after_backward", "loss", "report", "close"}
    assert hooks <= methods
    missing = {m for m in methods if not callable(getattr(side, m, None))}
    assert not missing, f"{side.__name__} lacks {sorted(missing)}"


def test_each_side_holds_its_media() -> None:
    assert isinstance(inspect.getattr_static(StepSide, "media"), property)
    media = OneProcess(None).media
    assert media.choice.media == "in process"
    assert media.inline_receives == []  # nothing received inline: no other process
    assert "media" in inspect.signature(CrossProcess.__init__).parameters


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_program_in_one_process_equals_the_plain_model(make_pipe, program: str) -> None:
    model = _model()
    plain = copy.deepcopy(model)
    pipe = make_pipe(model, [2, 3], devices=["cpu", "cpu"], chunks=3, schedule="1f1b")
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    loss_fn = nn.functional.mse_loss if program != "forward" else None
    request = StepRequest(program, 3, "always", loss_fn)
    got = pipeline_of(pipe).run(request, x, y)  # type: ignore[union-attr]
    if program == "forward":
        torch.testing.assert_close(got, plain(x), rtol=1e-12, atol=0)
        assert all(p.grad is None for p in model.parameters())
        return
    expected = nn.functional.mse_loss(plain(x), y)
    torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=0)
    if program == "evaluate":
        assert all(p.grad is None for p in model.parameters())
        return
    expected.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0, msg=name)


def test_a_request_names_an_unknown_program() -> None:
    with pytest.raises(ValueError, match=r"program must be one of .* got 'backward'"):
        StepRequest("backward", 2)


def test_a_step_without_a_callable_loss_is_refused_before_it_runs(make_pipe) -> None:
    pipe = make_pipe(_model(), [2, 3], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pipeline_of(pipe).run(StepRequest("evaluate", 2), x, x)  # type: ignore[union-attr]


class _HookLog:
    """A side that logs each hook Pipeline.run calls, then does what the side it wraps does."""

    def __init__(self, side: Any) -> None:
        self.side = side
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.side, name)

    def share(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("share")
        return self.side.share(*args, **kwargs)

    @contextmanager
    def running(self, *, backward: bool) -> Iterator[None]:
        self.calls.append(f"running(backward={backward})")
        with self.side.running(backward=backward):
            yield
        self.calls.append("ran")

    def before_step(self) -> None:
        self.calls.append("before_step")
        self.side.before_step()

    def after_backward(self) -> None:
        self.calls.append("after_backward")
        self.side.after_backward()

    def loss(self, local: Tensor | None) -> Tensor:
        self.calls.append("loss")
        return self.side.loss(local)


RUN_HOOKS = {
    "train": ["share", "running(backward=True)", "before_step", "after_backward", "ran", "loss"],
    "evaluate": ["share", "running(backward=False)", "before_step", "ran", "loss"],
    "forward": ["share", "running(backward=False)", "before_step", "ran"],
}


@pytest.mark.parametrize("program", PROGRAMS)
def test_run_calls_the_sides_hooks_in_order(make_pipe, program: str) -> None:
    pipe = make_pipe(_model(), [2, 3], devices=["cpu", "cpu"], chunks=2)
    pipeline: Any = pipeline_of(pipe)
    log = pipeline.side = _HookLog(pipeline.side)
    loss_fn = nn.functional.mse_loss if program != "forward" else None
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    pipeline.run(StepRequest(program, 2, loss_fn=loss_fn), x, y)
    assert log.calls == RUN_HOOKS[program]


def test_a_failed_step_ends_inside_running_before_after_backward(make_pipe) -> None:
    pipe = make_pipe(_model(), [2, 3], devices=["cpu", "cpu"], chunks=2)
    pipeline: Any = pipeline_of(pipe)
    log = pipeline.side = _HookLog(pipeline.side)

    def broken_loss(output: Tensor, target: Tensor) -> Tensor:
        raise ValueError("no loss today")

    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="no loss today"):
        pipeline.run(StepRequest("train", 2, loss_fn=broken_loss), x, y)
    assert log.calls == ["share", "running(backward=True)", "before_step"]
    assert all(p.grad is None for p in pipe.parameters())

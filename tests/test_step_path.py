"""The one step path: a StepRequest run on either side gives the plain model's values, and
both sides do everything the StepSide protocol asks (the processes' side of each program is
covered in test_multiprocess.py and test_sharded.py)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

from gpipe_fast.api.gpipe import pipeline_of
from gpipe_fast.distributed.driver import CrossProcess
from gpipe_fast.runtime.one_process import OneProcess
from gpipe_fast.runtime.step_path import run_step
from gpipe_fast.runtime.step_request import PROGRAMS, StepRequest, StepSide


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()


@pytest.mark.parametrize("side", [OneProcess, CrossProcess])
def test_each_side_has_every_method_of_the_protocol(side: type) -> None:
    methods = {name for name, _ in inspect.getmembers(StepSide, inspect.isfunction)}
    assert {"share", "run", "loss", "after_backward", "report", "close"} <= methods
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
    got = run_step(pipeline_of(pipe), request, x, y)
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
        run_step(pipeline_of(pipe), StepRequest("evaluate", 2), x, x)

"""pipe.clip_grad_norm_ in one process: torch's clipping of the whole model (the ranks' case
is in tests/test_multiprocess.py)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf


def _model(tie: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(6, 6), nn.Tanh()]
    if tie:  # the last Linear uses the first one's weight
        layers[6].weight = layers[0].weight  # type: ignore[union-attr]
    return nn.Sequential(*layers).double()


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients under the model's own keys (a pipe's state_dict uses them too)."""
    state = module.state_dict(keep_vars=True)
    return {n: p.grad.clone() for n, p in state.items() if p.grad is not None}


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, "inf", 3.0])
@pytest.mark.parametrize("tie", [False, True])
def test_the_norm_and_the_clipped_gradients_are_the_plain_models(
    make_pipe: Any, norm_type: Any, tie: bool
) -> None:
    plain = _model(tie)
    pipe = make_pipe(copy.deepcopy(plain), [2, 2, 2, 2], chunks=3, schedule="1f1b")
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randn(10, 6, dtype=torch.float64)
    nn.functional.mse_loss(plain(x), y).backward()
    pipe.train_step(x, y, nn.functional.mse_loss)
    norm_before = torch.nn.utils.get_total_norm(
        [p.grad for p in plain.parameters() if p.grad is not None], norm_type
    )
    max_norm = 0.3 * norm_before.item()  # clips
    expected = nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
    got = pipe.clip_grad_norm_(max_norm, norm_type)
    assert isinstance(got, torch.Tensor) and got.dim() == 0
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)
    want, have = _grads(plain), _grads(pipe)
    assert set(have) == set(want)
    for name, grad in want.items():
        torch.testing.assert_close(have[name], grad, rtol=1e-10, atol=1e-14, msg=name)


def test_a_norm_below_max_norm_leaves_the_gradients(make_pipe: Any) -> None:
    pipe = make_pipe(_model(False), [4, 4], chunks=2)
    pipe.train_step(torch.randn(4, 6).double(), torch.randn(4, 6).double(), nn.functional.mse_loss)
    before = _grads(pipe)
    norm = pipe.clip_grad_norm_(1e6)
    assert norm.item() > 0
    for name, grad in _grads(pipe).items():
        assert torch.equal(grad, before[name]), name


def test_without_gradients_the_norm_is_zero(make_pipe: Any) -> None:
    pipe = make_pipe(_model(False), [4, 4])
    assert pipe.clip_grad_norm_(1.0).item() == 0.0


def test_a_nonfinite_norm_raises_when_asked(make_pipe: Any) -> None:
    pipe = make_pipe(_model(False), [4, 4], chunks=2)
    pipe.train_step(torch.randn(4, 6).double(), torch.randn(4, 6).double(), nn.functional.mse_loss)
    next(pipe.parameters()).grad[0, 0] = float("nan")
    assert math.isnan(pipe.clip_grad_norm_(1.0).item())  # torch's behaviour: no error
    with pytest.raises(RuntimeError, match="non-finite"):
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_norm": 0.0}, ValueError, "max_norm must be > 0"),
        ({"max_norm": -1}, ValueError, "max_norm must be > 0"),
        ({"max_norm": "1"}, TypeError, "max_norm must be a number"),
        ({"max_norm": 1.0, "norm_type": 0}, ValueError, "norm_type must be > 0"),
        ({"max_norm": 1.0, "norm_type": "fro"}, ValueError, "norm_type must be a number"),
        ({"max_norm": 1.0, "norm_type": float("nan")}, ValueError, "norm_type must be > 0"),
    ],
)
def test_bad_arguments_are_named(make_pipe: Any, kwargs: dict[str, Any], error: type,
                                 match: str) -> None:  # fmt: skip
    pipe = make_pipe(_model(False), [4, 4])
    with pytest.raises(error, match=match):
        pipe.clip_grad_norm_(**kwargs)


def test_an_empty_pipe_clips_nothing() -> None:
    pipe = gf.GPipe(nn.Sequential(), [])
    assert pipe.clip_grad_norm_(1.0).item() == 0.0

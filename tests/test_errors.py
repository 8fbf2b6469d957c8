"""Bad configuration and errors raised inside cells: clear messages, the pipe stays usable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpipe_fast as gf

from helpers import assert_same_run, mlp, pipe_run, reference_run


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"balance": [2, 2]}, ValueError, "balance"),  # sums to 4, module has 6
        ({"balance": [3, 0, 3]}, ValueError, "balance"),  # an empty cell
        ({"balance": [3, 3], "devices": ["cpu"]}, ValueError, "devices"),
        ({"balance": [6], "chunks": 0}, ValueError, "chunks"),
        ({"balance": [6], "chunks": 2.0}, TypeError, "chunks"),
        ({"balance": [6], "checkpoint": "sometimes"}, ValueError, "checkpoint"),
        ({"balance": [3.0, 3]}, TypeError, "balance"),
        ({"balance": [6], "devices": ["tpu"]}, ValueError, "devices"),
        ({"balance": [6], "devices": "cpu"}, TypeError, "devices"),
    ],
)
def test_bad_configuration_names_the_argument(kwargs: dict, error: type, names: str) -> None:
    with pytest.raises(error, match=names):
        gf.GPipe(mlp(3), **kwargs)


def test_module_must_be_sequential() -> None:
    with pytest.raises(TypeError, match="module"):
        gf.GPipe(nn.Linear(2, 2), [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="module"):
        gf.GPipe(nn.Sequential(), [1])


def test_parameter_shared_by_two_cells_is_rejected() -> None:
    shared = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="shared"):
        gf.GPipe(nn.Sequential(shared, nn.ReLU(), shared), [2, 1], devices=["cpu", "cpu"])


class _Fail(nn.Module):
    """Raises in forward or backward for one chosen micro-batch size marker."""

    def __init__(self, where: str, error: type[Exception]) -> None:
        super().__init__()
        self.where, self.error, self.armed = where, error, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and self.where == "forward" and not gf.is_recomputing():
            raise self.error("planted in forward")
        if self.armed and self.where == "backward":
            return _RaiseInBackward.apply(x, self.error)
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, error):  # type: ignore[no-untyped-def]
        ctx.error = error
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        raise ctx.error("planted in backward")


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("error", [KeyError, ZeroDivisionError, RuntimeError])
def test_cell_error_reaches_caller_and_pipe_recovers(make_pipe, where: str, error: type) -> None:
    fail = _Fail(where, error)
    module = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), fail, nn.Linear(6, 6)).double()
    pipe = make_pipe(module, [2, 2], devices=["cpu", "cpu"], chunks=3)
    x = torch.randn(6, 6, dtype=torch.float64)
    with pytest.raises(error) as caught:
        pipe(x).sum().backward()
    message = str(caught.value)
    assert "planted in " + where in message
    assert "cell 1" in message and "micro-batch" in message
    assert where in message.split("planted")[0]  # the pass is named before the original text
    fail.armed = False
    assert_same_run(pipe_run(pipe, module, x), reference_run(module, x))


def test_cell_returning_a_non_tensor_is_a_type_error(make_pipe) -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            return [x]

    pipe = make_pipe(nn.Sequential(nn.Linear(2, 2), Bad()), [1, 1], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="cell 1"):
        pipe(torch.randn(3, 2))


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ([torch.randn(2, 2)], TypeError),
        ((torch.randn(2, 2), torch.randn(3, 2)), ValueError),
        (torch.randn(0, 2), ValueError),
        (torch.tensor(1.0), ValueError),
    ],
)
def test_bad_input_is_rejected(make_pipe, value: object, error: type) -> None:
    pipe = make_pipe(nn.Sequential(nn.Identity(), nn.Identity()), [1, 1], devices=["cpu", "cpu"])
    with pytest.raises(error, match="input"):
        pipe(value)

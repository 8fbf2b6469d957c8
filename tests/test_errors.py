"""Bad configuration and errors raised inside cells: clear messages, the pipe stays usable."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gpipe_fast as gf

from helpers import RaiseInBackward, assert_same_run, mlp, no_hang, pipe_run, reference_run


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"balance": [2, 2]}, ValueError, "balance"),  # sums to 4, module has 6
        ({"balance": [3, 0, 3]}, ValueError, "balance"),  # an empty cell
        ({"balance": [3, 3], "devices": ["cpu"]}, ValueError, "devices"),
        ({"balance": [6], "chunks": 0}, ValueError, "chunks"),
        ({"balance": [6], "chunks": 2.5}, TypeError, "chunks"),  # 2.0 would be taken as 2
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


def test_a_layer_used_by_two_cells_gets_the_gradient_of_both_uses() -> None:
    # Once refused; now a tie (gpipe_fast.nn.tied): the cells on one device share the tensor.
    shared = nn.Linear(3, 3).double()
    model = nn.Sequential(shared, nn.ReLU(), shared)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    reference(x).sum().backward()
    pipe = gf.GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
    try:
        pipe(x).sum().backward()
    finally:
        pipe.close()
    torch.testing.assert_close(shared.weight.grad, reference[0].weight.grad)


class _Fail(nn.Module):
    """Raises in forward or backward for one chosen micro-batch size marker."""

    def __init__(self, where: str, error: type[Exception]) -> None:
        super().__init__()
        self.where, self.error, self.armed = where, error, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and self.where == "forward" and not gf.is_recomputing():
            raise self.error("planted in forward")
        if self.armed and self.where == "backward":
            return RaiseInBackward.apply(x, self.error("planted in backward"))
        return x


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


def test_a_cell_output_that_cannot_be_gathered_is_named(make_pipe) -> None:
    # Any pytree may be returned (a list here); the pipe's output is joined leaf by leaf, and
    # a string that differs between micro-batches cannot be.
    class Tagged(nn.Module):
        def forward(self, x: torch.Tensor) -> list[object]:
            return [x, f"{x.size(0)} rows"]

    pipe = make_pipe(
        nn.Sequential(nn.Linear(2, 2), Tagged()), [1, 1], devices=["cpu", "cpu"], chunks=2
    )
    out = pipe(torch.randn(4, 2))
    assert type(out) is list and out[1] == "2 rows" and out[0].shape == (4, 2)
    with pytest.raises(ValueError, match=r"output\[1\] is '2 rows' in micro-batch 0 but '1 rows'"):
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


class _Returns(nn.Module):
    """The last cell's layer: returns what `make` builds from its micro-batch."""

    def __init__(self, make) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        return self.make(x)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda x: (x, x[:1]), ValueError, r"output tensors have different batch sizes"),
        (lambda x: x.sum(), ValueError, r"output\[0\] is a scalar tensor"),
        (lambda x: (x, x.sum()), ValueError, r"output\[1\] is a scalar tensor"),
    ],
)
def test_pipe_output_without_a_common_batch_dim_is_rejected(
    make_pipe, make, error: type, match: str, chunks: int
) -> None:
    # Its gradient could not be split back into micro-batches: say so in forward, not with
    # an obscure error in backward.
    last = _Returns(make)
    pipe = make_pipe(
        nn.Sequential(nn.Linear(2, 2), last), [1, 1], devices=["cpu"] * 2, chunks=chunks
    )
    with no_hang(), pytest.raises(error, match=match):
        pipe(torch.randn(4, 2))
    last.make = lambda x: (x, x[:, :1])  # a tuple sharing its batch dim is fine
    out = pipe(torch.randn(4, 2))
    (out[0].sum() + out[1].sum()).backward()


@pytest.mark.parametrize("track", [True, False])
def test_output_dtype_changing_between_microbatches_is_a_type_error(make_pipe, track: bool) -> None:
    # Micro-batches of 4 and 3 samples; the cell returns float64 for the smaller one only.
    last = _Returns(lambda x: x.double() if x.size(0) == 3 else x)
    pipe = make_pipe(nn.Sequential(nn.Linear(2, 2), last), [1, 1], devices=["cpu"] * 2, chunks=2)
    with (
        no_hang(),
        pytest.raises(
            TypeError, match=r"output\[0\].*float32.*micro-batch 0.*float64.*micro-batch 1"
        ),
    ):
        with torch.set_grad_enabled(track):
            pipe(torch.randn(7, 2))
    last.make = lambda x: x
    pipe(torch.randn(7, 2)).sum().backward()


def test_input_device_must_be_cpu_or_cuda(make_pipe) -> None:
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    pipe = make_pipe(module, [1, 1], devices=["cpu"] * 2, chunks=2)
    for bad in (
        torch.empty(4, 2, device="meta"),
        (torch.randn(4, 2), torch.empty(4, device="meta")),
    ):
        with no_hang(), pytest.raises(ValueError, match=r"input\[\d\] is on device meta"):
            pipe(bad)
    # A CPU tensor for a CPU pipe (or any cpu/cuda tensor: it is moved to devices[0]) works.
    x = torch.randn(4, 2)
    torch.testing.assert_close(pipe(x), module(x))

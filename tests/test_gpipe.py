"""GPipe against the unpartitioned module: outputs and every gradient, for all K, M, modes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gpipe_fast as gf

from helpers import assert_same_run, mlp, pipe_run, reference_run

BALANCES = {1: [6], 2: [3, 3], 3: [1, 4, 1], 4: [2, 1, 2, 1]}


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("cells", [1, 2, 3, 4])
def test_matches_unpartitioned_module(make_pipe, cells: int, chunks: int, checkpoint: str) -> None:
    module = mlp(3)
    x = torch.randn(11, 6, dtype=torch.float64)  # 11: uneven for 3 and 8 micro-batches
    want = reference_run(module, x)
    pipe = make_pipe(
        module, BALANCES[cells], devices=["cpu"] * cells, chunks=chunks, checkpoint=checkpoint
    )
    assert_same_run(pipe_run(pipe, module, x), want)
    # The pipe is reusable: a second step on fresh data is right too.
    x2 = torch.randn(5, 6, dtype=torch.float64)
    assert_same_run(pipe_run(pipe, module, x2), reference_run(module, x2))


@pytest.mark.parametrize("batch", [1, 2, 7, 9])
def test_batch_smaller_or_not_divisible_by_chunks(make_pipe, batch: int) -> None:
    module = mlp(2)
    pipe = make_pipe(module, [2, 2], devices=["cpu", "cpu"], chunks=4)
    x = torch.randn(batch, 6, dtype=torch.float64)
    out, *_ = got = pipe_run(pipe, module, x)
    assert out.shape == (batch, 6)  # nothing dropped or padded
    assert_same_run(got, reference_run(module, x))


class _Split(nn.Module):
    """Returns a tuple, to carry a pair of tensors between cells."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin(), x * 2


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] * self.scale + pair[1]


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_tuple_values_cross_cells(make_pipe, checkpoint: str) -> None:
    module = nn.Sequential(nn.Linear(4, 4), _Split(), _Join(), nn.Linear(4, 3)).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe = make_pipe(module, [2, 1, 1], devices=["cpu"] * 3, chunks=3, checkpoint=checkpoint)
    assert_same_run(pipe_run(pipe, module, x), reference_run(module, x))


class _Pair(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return pair[0] + pair[1], pair[1]


def test_tuple_input_and_output(make_pipe) -> None:
    module = nn.Sequential(_Pair(), _Pair()).double()
    a = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    pipe = make_pipe(module, [1, 1], devices=["cpu", "cpu"], chunks=2)
    out = pipe((a, b))
    assert isinstance(out, tuple) and len(out) == 2
    (out[0].sum() + 3 * out[1].sum()).backward()
    torch.testing.assert_close(a.grad, torch.ones_like(a))
    torch.testing.assert_close(b.grad, torch.full_like(b, 5.0))


def test_two_forwards_then_one_backward_accumulate(make_pipe) -> None:
    module = mlp(2)
    x1, x2 = torch.randn(6, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    ref = copy.deepcopy(module)
    (ref(x1).sum() + (ref(x2) ** 2).sum()).backward()
    pipe = make_pipe(module, [2, 2], devices=["cpu", "cpu"], chunks=2)
    (pipe(x1).sum() + (pipe(x2) ** 2).sum()).backward()
    for got, want in zip(module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


def test_no_grad_and_eval(make_pipe) -> None:
    module = mlp(2)
    x = torch.randn(7, 6, dtype=torch.float64)
    pipe = make_pipe(module, [2, 2], devices=["cpu", "cpu"], chunks=3)
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, module(x).detach(), rtol=1e-10, atol=1e-12)
    pipe.eval()
    seen: list[bool] = []
    module[0].register_forward_hook(lambda *_: seen.append(gf.is_checkpointing()))
    out = pipe(x)
    out.sum().backward()  # eval with grad still trains, without checkpointing
    assert seen and not any(seen)
    assert module[0].weight.grad is not None


def test_backward_twice_is_a_clear_error(make_pipe) -> None:
    module = mlp(2)
    pipe = make_pipe(module, [2, 2], devices=["cpu", "cpu"], chunks=2)
    out = pipe(torch.randn(4, 6, dtype=torch.float64))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        out.sum().backward()


def test_state_dict_has_the_modules_tensors_and_keys(make_pipe) -> None:
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    want = module.state_dict()
    pipe = make_pipe(module, [2, 1], devices=["cpu", "cpu"])
    got = pipe.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert got[key].data_ptr() == want[key].data_ptr(), key
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    pipe.load_state_dict(fresh.state_dict())
    torch.testing.assert_close(module[0].weight, fresh[0].weight)


def test_partitions_and_attributes(make_pipe) -> None:
    module = mlp(3)
    pipe = make_pipe(module, [2, 4], devices=["cpu", "cpu", "cpu"], chunks=5, checkpoint="never")
    assert pipe.balance == [2, 4]
    assert pipe.devices == [torch.device("cpu")] * 2  # extra devices are left unused
    assert pipe.chunks == 5 and pipe.checkpoint == "never"
    assert [len(cell) for cell in pipe.partitions] == [2, 4]
    assert pipe.partitions[1][0] is module[2]  # cells hold the user's own layers
    assert len(pipe) == 6


def test_default_balance_uses_parameters(make_pipe) -> None:
    module = nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2), nn.ReLU(), nn.Linear(2, 2)
    )
    pipe = make_pipe(module, devices=["cpu", "cpu"])
    assert pipe.balance == gf.balance_by_params(2, module)
    assert sum(pipe.balance) == 5

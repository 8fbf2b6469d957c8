"""GPipe against the unpartitioned module: outputs and every gradient, for all K, M, modes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast.api.devices import TooFewDevicesError
from gpipe_fast.device import host

from helpers import assert_same_run, mlp, native_threads, pipe_run, reference_run

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


# -- defaults -----------------------------------------------------------------------------------

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only defaults")


@no_cuda
@pytest.mark.parametrize(("cores", "threads"), [(2, 1), (12, 4)])
def test_default_devices_on_cpu_are_one_per_cell(make_pipe, monkeypatch, cores, threads) -> None:
    monkeypatch.setattr(host, "cpu_cores", lambda: cores)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    module = mlp(3)
    pipe = make_pipe(module, [2, 2, 2], chunks=3)  # more cells than cores is fine
    assert pipe.devices == [torch.device("cpu")] * 3
    assert pipe.threads_per_cell == threads  # the cores shared out among the cells
    if cores == 2:  # run it for real only with no more threads than this machine may have
        x = torch.randn(7, 6, dtype=torch.float64)
        assert_same_run(pipe_run(pipe, module, x), reference_run(module, x))


@no_cuda
def test_threads_per_cell_is_yours_when_given(make_pipe, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pipe = make_pipe(mlp(2), [2, 2], threads_per_cell=1)
    assert pipe.threads_per_cell == 1
    assert pipe.threads_reason == "threads_per_cell=1, as given"
    with pytest.raises(ValueError, match="threads_per_cell must be >= 1"):
        make_pipe(mlp(2), [2, 2], threads_per_cell=0)
    with pytest.raises(TypeError, match="threads_per_cell must be an int or None"):
        make_pipe(mlp(2), [2, 2], threads_per_cell=1.5)


@no_cuda
@pytest.mark.parametrize(("cores", "cells"), [(1, 1), (2, 2), (4, 4), (64, 6)])
def test_default_balance_on_cpu_is_one_cell_per_core(make_pipe, monkeypatch, cores, cells):
    monkeypatch.setattr(host, "cpu_cores", lambda: cores)
    module = mlp(3)  # 6 layers: never more cells than layers
    pipe = make_pipe(module)
    assert pipe.balance == gf.balance_by_params(cells, module)
    assert pipe.devices == [torch.device("cpu")] * cells


# -- the pipe as a sequence of layers -------------------------------------------------------------


@pytest.mark.parametrize("balance", [[6], [1, 5], [2, 2, 2], [1, 1, 1, 1, 1, 1]])
def test_indexing_walks_the_layers_across_cells(make_pipe, balance: list[int]) -> None:
    module = mlp(3)
    pipe = make_pipe(module, balance, devices=["cpu"] * len(balance))
    assert len(pipe) == 6
    assert list(pipe) == list(module)
    for i in range(6):
        assert pipe[i] is module[i]
        assert pipe[i - 6] is module[i]
    assert pipe[-1] is module[5]
    for past in (6, -7, 100):
        with pytest.raises(IndexError, match=f"layer index {past} is out of range"):
            pipe[past]
    with pytest.raises(TypeError, match="integers"):
        pipe["0"]  # type: ignore[index]


# -- moving and casting ---------------------------------------------------------------------------

MOVES = {
    "cuda()": lambda pipe: pipe.cuda(),
    "cuda(0)": lambda pipe: pipe.cuda(0),
    "cpu()": lambda pipe: pipe.cpu(),
    "to(device)": lambda pipe: pipe.to(torch.device("cpu")),
    "to('cpu')": lambda pipe: pipe.to("cpu"),
    "to('cuda')": lambda pipe: pipe.to("cuda"),
    "to(0)": lambda pipe: pipe.to(0),
    "to(device=)": lambda pipe: pipe.to(device="cpu"),
    "to(device, dtype)": lambda pipe: pipe.to("cpu", torch.float64),
    "to(device=, dtype=)": lambda pipe: pipe.to(device="cpu", dtype=torch.float64),
    "to(tensor)": lambda pipe: pipe.to(torch.zeros(1, dtype=torch.float64)),
    "to(tensor=)": lambda pipe: pipe.to(tensor=torch.zeros(1)),
    "to_empty": lambda pipe: pipe.to_empty(device="cpu"),
}


@pytest.mark.parametrize("move", MOVES)
def test_moving_the_pipe_is_a_type_error_that_says_why(make_pipe, move: str) -> None:
    module = mlp(2)
    pipe = make_pipe(module, [2, 2], devices=["cpu", "cpu"], chunks=2)
    weights = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(TypeError, match=r"out of step with pipe\.devices") as caught:
        MOVES[move](pipe)
    assert "build a new GPipe" in str(caught.value)
    # Nothing moved or changed, and the pipe still trains.
    for before, after in zip(weights, module.parameters(), strict=True):
        assert after.dtype == torch.float64 and torch.equal(before, after)
    x = torch.randn(5, 6, dtype=torch.float64)
    assert_same_run(pipe_run(pipe, module, x), reference_run(module, x))


def test_casting_the_pipe_casts_the_models_own_weights(make_pipe) -> None:
    module = mlp(2).float()
    pipe = make_pipe(module, [2, 2], devices=["cpu", "cpu"], chunks=3)
    assert pipe.double() is pipe
    assert all(p.dtype == torch.float64 for p in module.parameters())
    x = torch.randn(7, 6, dtype=torch.float64)
    assert_same_run(pipe_run(pipe, module, x), reference_run(module, x))
    for cast_to, want in [
        (lambda: pipe.half(), torch.float16),
        (lambda: pipe.to(torch.float32), torch.float32),
        (lambda: pipe.to(dtype=torch.bfloat16), torch.bfloat16),
        (lambda: pipe.to(torch.float64, non_blocking=True), torch.float64),
        (lambda: pipe.float(), torch.float32),
    ]:
        assert cast_to() is pipe
        assert all(p.dtype == want for p in module.parameters())


# -- argument conversions -----------------------------------------------------------------------


class _IndexLike:
    """An int-like that is no int: converts through __index__, as numpy ints do."""

    def __index__(self) -> int:
        return 3


class _Mode(str):
    pass


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


@pytest.mark.parametrize(
    ("chunks", "want"), [(42.0, 42), (_IndexLike(), 3), (torch.tensor(5), 5), (4, 4)]
)
def test_chunks_that_convert_without_loss_are_taken(make_pipe, chunks: object, want: int) -> None:
    pipe = make_pipe(mlp(1), [2], devices=["cpu"], chunks=chunks)
    assert pipe.chunks == want and type(pipe.chunks) is int


def test_numpy_chunks_are_taken(make_pipe) -> None:
    np = pytest.importorskip("numpy")
    for chunks in (np.int64(6), np.int32(2), np.float64(8.0)):
        pipe = make_pipe(mlp(1), [2], devices=["cpu"], chunks=chunks)
        assert pipe.chunks == int(chunks) and type(pipe.chunks) is int


@pytest.mark.parametrize(
    "chunks", [2.5, "8", True, False, None, float("nan"), float("inf"), torch.tensor(2.0)]
)
def test_chunks_that_would_lose_something_are_rejected(chunks: object) -> None:
    with pytest.raises(TypeError, match="chunks must be an int"):
        gf.GPipe(mlp(1), [2], devices=["cpu"], chunks=chunks)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunks", [0, -1, 0.0, -3.0])
def test_chunks_below_one_are_rejected(chunks: object) -> None:
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        gf.GPipe(mlp(1), [2], devices=["cpu"], chunks=chunks)  # type: ignore[arg-type]


@pytest.mark.parametrize("checkpoint", [_Mode("never"), _Named("always"), "except_last"])
def test_str_like_checkpoint_modes_are_taken(make_pipe, checkpoint: object) -> None:
    pipe = make_pipe(mlp(1), [2], devices=["cpu"], checkpoint=checkpoint)
    assert pipe.checkpoint == str(checkpoint) and type(pipe.checkpoint) is str


@pytest.mark.parametrize("checkpoint", [True, None, b"always", "ALWAYS", 1, _Named("sometimes")])
def test_other_checkpoint_values_are_rejected(checkpoint: object) -> None:
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        gf.GPipe(mlp(1), [2], devices=["cpu"], checkpoint=checkpoint)  # type: ignore[arg-type]


# -- the empty pipe -----------------------------------------------------------------------------


@pytest.mark.parametrize("balance", [[], None])
def test_empty_module_is_the_identity_without_workers(make_pipe, balance) -> None:
    workers = native_threads("gpipe-cell")
    pipe = make_pipe(nn.Sequential(), balance, chunks=4)
    assert pipe.balance == [] and pipe.devices == [] and len(pipe) == 0 and list(pipe) == []
    assert pipe.state_dict() == {} and pipe.memory_stats() == []
    x = torch.randn(5, 3, requires_grad=True)
    out = pipe(x)
    assert out is x
    (out * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    pair = (torch.randn(2), torch.randn(4))
    assert pipe(pair) is pair
    with pytest.raises(TypeError, match="input must be a Tensor"):
        pipe(42)
    with pytest.raises(IndexError):
        pipe[0]
    assert native_threads("gpipe-cell") == workers  # no worker was started for it


def test_empty_module_takes_no_cells() -> None:
    with pytest.raises(ValueError, match="sums to 1, but module has 0 layers"):
        gf.GPipe(nn.Sequential(), [1])


# -- errors a torchgpipe user would catch --------------------------------------------------------


def test_too_few_devices_is_both_value_and_index_error() -> None:
    for error in (ValueError, IndexError):
        with pytest.raises(error, match="devices: 3 cells need 3 devices, got 2"):
            gf.GPipe(mlp(3), [2, 2, 2], devices=["cpu", "cpu"])
    with pytest.raises(TooFewDevicesError, match="devices"):
        gf.GPipe(mlp(1), devices=[])


@pytest.mark.parametrize(
    ("balance", "problem"),
    [
        ([2, 2], "sums to 4, but module has 6 layers"),
        ([3, 0, 3], r"balance\[1\] = 0"),
        ([], "at least one cell"),
        ([7], "sums to 7"),
    ],
)
def test_balance_that_does_not_fit_names_the_balancing_helpers(balance, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as caught:
        gf.GPipe(mlp(3), balance, devices=["cpu"] * 3)
    message = str(caught.value)
    for helper in ("gf.balance_by_params(", "gf.balance_by_time(", "gf.balance_by_size("):
        assert helper in message

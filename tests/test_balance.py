"""Balance estimators on modules with deliberately uneven layers."""

from __future__ import annotations

import math
import warnings
from typing import ClassVar

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast.balancing import balance as gb
from gpipe_fast.balancing import profile as gp

from helpers import Sleepy, funnel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Widen(nn.Module):
    """Parameter-free layer with a 64x wider output: big activations, no parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, 64)


def widening() -> nn.Sequential:
    # Output bytes on a batch of 8 (float32): 512, 512, 32768, 512, 512.
    # Parameter bytes: 1088, 1088, 0, 65600, 1088.
    return nn.Sequential(
        nn.Linear(16, 16), nn.Linear(16, 16), Widen(), nn.Linear(1024, 16), nn.Linear(16, 16)
    )


def snapshot(module: nn.Module) -> dict[str, object]:
    """Everything a profiler could disturb: modes, flags, grads, devices, values, buffers."""
    return {
        "training": [m.training for m in module.modules()],
        "requires_grad": [p.requires_grad for p in module.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in module.parameters()],
        "devices": [t.device for t in [*module.parameters(), *module.buffers()]],
        "params": [p.detach().clone() for p in module.parameters()],
        "buffers": [b.clone() for b in module.buffers()],
        "ids": [id(p) for p in module.parameters()],
    }


def assert_same_snapshot(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        left, right = a[key], b[key]
        assert isinstance(left, list) and isinstance(right, list)
        assert len(left) == len(right), key
        for x, y in zip(left, right, strict=True):
            if isinstance(x, torch.Tensor):
                assert isinstance(y, torch.Tensor) and torch.equal(x, y), key
            else:
                assert x == y, key


# -- parameter counts ---------------------------------------------------------------------------


def test_layer_costs_by_params_count_elements_plus_one() -> None:
    assert gp.layer_costs_by_params(funnel()) == [273.0, 4353.0, 65793.0, 4113.0, 273.0]


@pytest.mark.parametrize(("partitions", "want"), [(1, [5]), (2, [2, 3]), (3, [2, 1, 2])])
def test_balance_by_params(partitions: int, want: list[int]) -> None:
    assert gf.balance_by_params(partitions, funnel()) == want


def test_parameter_free_layers_are_placed_evenly() -> None:
    assert gf.balance_by_params(2, nn.Sequential(*[nn.ReLU() for _ in range(6)])) == [3, 3]
    # Costs 1, 1, 21, 1, 1, 21: only [3, 3] splits them 23 | 23.
    module = nn.Sequential(
        nn.ReLU(), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.ReLU(), nn.Linear(4, 4)
    )
    assert gf.balance_by_params(2, module) == [3, 3]


# -- measured time ------------------------------------------------------------------------------


def test_balance_by_time_follows_forward_time() -> None:
    # Forward ms 5, 5, 5, 5, 30: [4, 1] (20 | 30) beats [3, 2] (15 | 35) by 5 ms.
    module = nn.Sequential(*[Sleepy(5) for _ in range(4)], Sleepy(30))
    x = torch.randn(4, 8)
    assert gf.balance_by_time(2, module, x, warmup=1, repeats=3) == [4, 1]


def test_balance_by_time_measures_backward_separately() -> None:
    # Backward ms ~0, 30, 5, 5, 5, 5 (the Linear makes gradients flow): [2, 4] (30 | 20).
    module = nn.Sequential(nn.Linear(8, 8), Sleepy(0, 30), *[Sleepy(0, 5) for _ in range(4)])
    x = torch.randn(4, 8)
    profile = gp.profile_layers(module, x, warmup=1, repeats=3)
    assert profile.backward[1] > 0.025 and all(0.004 < b < 0.025 for b in profile.backward[2:])
    assert all(f < 0.004 for f in profile.forward)
    assert profile.output_bytes == [4 * 8 * 4] * 6
    assert gf.balance_by_time(2, module, x, warmup=1, repeats=3, cost="backward") == [2, 4]
    assert gf.balance_by_time(2, module, x, warmup=1, repeats=3) == [2, 4]


class _CountRuns(nn.Module):
    """Identity that counts its forward calls in a class attribute: profiling runs copies of
    the layer, whose instance attributes would be copied with it."""

    runs: ClassVar[list[int]] = []  # one count per instance, by its `index`

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CountRuns.runs[self.index] += 1
        return x * 1.0


def _counting(layers: int) -> nn.Sequential:
    _CountRuns.runs = [0] * layers
    return nn.Sequential(*[_CountRuns(i) for i in range(layers)])


class _FakeClock:
    """A clock that moves `tick` seconds each time it is read, whatever the machine does."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_timeout_spends_an_even_share_of_the_budget_on_each_layer(monkeypatch) -> None:
    # Each clock read moves 1 ms. A run reads the clock at most 5 times (forward and backward
    # timed, then the budget checked), so a 50 ms share (0.2 s over 4 layers) gives each layer
    # at least 10 runs, and at most 50 (a run reads it at least once).
    monkeypatch.setattr(gp, "_clock", _FakeClock(0.001))
    gp.profile_layers(_counting(4), torch.randn(2, 3), warmup=0, timeout=0.2)
    assert all(10 <= runs <= 50 for runs in _CountRuns.runs), _CountRuns.runs
    assert len(set(_CountRuns.runs)) == 1  # the same share for every layer

    # A budget ten times larger buys about ten times the runs.
    monkeypatch.setattr(gp, "_clock", _FakeClock(0.001))
    gp.profile_layers(_counting(4), torch.randn(2, 3), warmup=0, timeout=2.0)
    assert all(100 <= runs <= 500 for runs in _CountRuns.runs), _CountRuns.runs


@pytest.mark.parametrize("warmup", [0, 2])
def test_timeout_zero_measures_each_layer_once(warmup: int) -> None:
    gp.profile_layers(_counting(3), torch.randn(2, 3), warmup=warmup, timeout=0)
    assert _CountRuns.runs == [warmup + 1] * 3


def test_repeats_count_measured_runs_after_warmup() -> None:
    gp.profile_layers(_counting(3), torch.randn(2, 3), warmup=2, repeats=4)
    assert _CountRuns.runs == [6] * 3
    gp.profile_layers(_counting(2), torch.randn(2, 3), warmup=1)
    assert _CountRuns.runs == [1 + gp.DEFAULT_REPEATS] * 2


def test_balance_by_time_takes_torchgpipes_timeout() -> None:
    # torchgpipe's own check: forward 10..60 ms; [4, 2] (100 | 110 ms) is the best cut.
    module = nn.Sequential(*[Sleepy(ms) for ms in (10, 20, 30, 40, 50, 60)])
    assert gf.balance_by_time(2, module, torch.rand(1), timeout=0.3, device="cpu") == [4, 2]


def test_no_backward_where_nothing_learns() -> None:
    module = nn.Sequential(Sleepy(0, 50), Sleepy(0, 50))
    profile = gp.profile_layers(module, torch.randn(2, 3), warmup=0, repeats=1)
    assert profile.backward == [0.0, 0.0]
    # ...unless the sample itself needs a gradient.
    x = torch.randn(2, 3, requires_grad=True)
    profile = gp.profile_layers(module, x, warmup=0, repeats=1)
    assert min(profile.backward) > 0.04


def test_profiling_leaves_the_module_as_it_was() -> None:
    module = nn.Sequential(
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(8, 8)
    )
    module.eval()
    module[4].weight.requires_grad_(False)
    module[0].weight.grad = torch.ones_like(module[0].weight)  # the user's, must survive
    x = torch.randn(16, 8)
    x_before = x.clone()
    before = snapshot(module)
    gf.balance_by_time(2, module, x, warmup=1, repeats=2)
    gf.balance_by_size(2, module, x)
    gf.plan(module, x, 2, 4, cost="time", warmup=0, repeats=1)
    assert_same_snapshot(before, snapshot(module))
    assert torch.equal(x, x_before)  # the in-place ReLU worked on copies


def test_tuple_values_flow_between_layers() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x * 2

    class Join(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] + pair[1]

    module = nn.Sequential(nn.Linear(4, 4), Split(), Join())
    profile = gp.profile_layers(module, torch.randn(3, 4), warmup=0, repeats=1)
    assert profile.output_bytes == [48, 96, 48]
    assert profile.backward[2] > 0.0


def test_a_layer_output_may_be_any_pytree() -> None:
    # As between cells: a list (or a dict, ...) is the next layer's input, its tensors count.
    class Listed(nn.Module):
        def forward(self, x: torch.Tensor) -> list[object]:
            return [x, "label"]

    profile = gp.profile_layers(nn.Sequential(nn.ReLU(), Listed()), torch.randn(2, 2), repeats=1)
    assert profile.output_bytes == [16, 16]


def test_in_place_first_layer_leaves_the_sample_alone() -> None:
    module = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8))
    x = torch.randn(6, 8)
    x_before = x.clone()
    gf.balance_by_time(2, module, x, warmup=0, repeats=2)
    gf.balance_by_size(2, module, x)
    assert torch.equal(x, x_before)


@cuda
def test_balance_by_time_on_cuda() -> None:
    module = nn.Sequential(*[Sleepy(5) for _ in range(4)], Sleepy(30))
    x = torch.randn(4, 8)
    assert gf.balance_by_time(2, module, x, device="cuda", warmup=1, repeats=3) == [4, 1]
    big = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4096), nn.Linear(4096, 64))
    before = snapshot(big)
    balance = gf.balance_by_time(2, big, torch.randn(256, 64), device="cuda")
    assert len(balance) == 2 and sum(balance) == 3
    assert_same_snapshot(before, snapshot(big))  # still on the CPU, untouched


# -- memory -------------------------------------------------------------------------------------


def test_layer_costs_by_size() -> None:
    module, x = widening(), torch.randn(8, 16)
    assert gp.layer_output_bytes(module, x) == [512, 512, 32768, 512, 512]
    assert gp.layer_param_bytes(module) == [1088, 1088, 0, 65600, 1088]
    assert gp.layer_costs_by_size(module, x, param_scale=0.5) == [
        1056,
        1056,
        32768,
        33312,
        1056,
    ]


@pytest.mark.parametrize(
    ("param_scale", "want"),
    [
        (0.0, [2, 1, 2]),  # activations only: the widened output sits alone
        (2.0, [3, 1, 1]),  # parameters (and their grads) dominate: the 1024-wide Linear alone
    ],
)
def test_balance_by_size(param_scale: float, want: list[int]) -> None:
    assert gf.balance_by_size(3, widening(), torch.randn(8, 16), param_scale=param_scale) == want


def test_balance_by_size_default_counts_gradients() -> None:
    assert gf.balance_by_size(3, widening(), torch.randn(8, 16)) == [3, 1, 1]


def test_size_chunks_count_activations_per_micro_batch() -> None:
    module = widening()
    whole = gp.layer_costs_by_size(module, torch.randn(8, 16), param_scale=0.5, chunks=8)
    # Output bytes of the 8-row mini-batch over 8 micro-batches: those of one row.
    assert whole == gp.layer_costs_by_size(module, torch.randn(1, 16), param_scale=0.5)
    assert whole == [64 + 544, 64 + 544, 4096, 64 + 32800, 64 + 544]


def test_balance_by_size_takes_torchgpipes_chunks() -> None:
    # Costs with param_scale 0.5. Whole batch: 1056, 1056, 32768, 33312, 1056: [2, 1, 2] keeps
    # the two big layers apart at 34368. Per micro-batch of 8: 608, 608, 4096, 32864, 608: the
    # parameters dominate, and the 1024-wide Linear alone is the best cut.
    module, x = widening(), torch.randn(8, 16)
    assert gf.balance_by_size(3, module, x, param_scale=0.5) == [2, 1, 2]
    assert gf.balance_by_size(3, module, x, param_scale=0.5, chunks=8) == [3, 1, 1]


# -- given costs --------------------------------------------------------------------------------


def test_balance_by_costs_list_and_length() -> None:
    assert gb.balance_by_costs(2, 4, [1.0, 1.0, 1.0, 3.0]) == [3, 1]
    assert gb.balance_by_costs(2, funnel(), [5, 1, 1, 1, 1]) == [1, 4]


def test_balance_by_costs_callable() -> None:
    def width(layer: nn.Module) -> float:
        assert isinstance(layer, nn.Linear)
        return float(layer.out_features)

    # Widths 16, 256, 256, 16, 16: the 256s cannot share a cell; [2, 2, 1] also reaches 272 but
    # [2, 1, 2] (272, 256, 32) is more even.
    assert gb.balance_by_costs(3, funnel(), width) == [2, 1, 2]


# -- bad input ----------------------------------------------------------------------------------


def _sample() -> torch.Tensor:
    return torch.randn(4, 16)


ESTIMATORS = {
    "params": lambda k, m: gf.balance_by_params(k, m),
    "time": lambda k, m: gf.balance_by_time(k, m, _sample(), warmup=0, repeats=1),
    "size": lambda k, m: gf.balance_by_size(k, m, _sample()),
    "costs": lambda k, m: gb.balance_by_costs(k, m, [1.0] * 5),
    "plan": lambda k, m: gf.plan(m, _sample(), k, 2, cost="params"),
}


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize(
    ("partitions", "error", "match"),
    [
        (0, ValueError, "partitions must be >= 1"),
        (6, ValueError, r"partitions \(6\) must not exceed the number of layers \(5\)"),
        (2.0, TypeError, "partitions must be an int"),
        (True, TypeError, "partitions must be an int"),
    ],
)
def test_bad_partitions(estimator: str, partitions: object, error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        ESTIMATORS[estimator](partitions, funnel())


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_bad_module(estimator: str) -> None:
    empty_name = "module_or_len" if estimator == "costs" else "module"
    with pytest.raises(ValueError, match=f"{empty_name} must have at least one layer"):
        ESTIMATORS[estimator](1, nn.Sequential())
    with pytest.raises(TypeError, match=empty_name):
        ESTIMATORS[estimator](1, nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: gb.balance_by_costs(2, 3, [1.0, math.nan, 1.0]), ValueError, r"costs\[1\] = nan"),
        (lambda: gb.balance_by_costs(2, 3, [1.0, -2.0, 1.0]), ValueError, r"costs\[1\] = -2"),
        (lambda: gb.balance_by_costs(2, 3, [1.0, 1.0]), ValueError, "costs has 2 entries"),
        (lambda: gb.balance_by_costs(2, 3, []), ValueError, "costs must not be empty"),
        (lambda: gb.balance_by_costs(2, 3, lambda layer: 1.0), TypeError, "module_or_len"),
        (lambda: gb.balance_by_costs(2, 0, [1.0]), ValueError, "module_or_len must be >= 1"),
        (lambda: gb.balance_by_costs(2, "3", [1.0]), TypeError, "module_or_len"),
        (
            lambda: gb.balance_by_costs(2, funnel(), lambda layer: -1.0),
            ValueError,
            r"costs\(module\[0\]\) = -1",
        ),
        (
            lambda: gb.balance_by_costs(2, funnel(), lambda layer: "big"),
            TypeError,
            r"costs\(module\[0\]\)",
        ),
        (lambda: gf.balance_by_time(2, funnel(), [1.0]), TypeError, "sample"),
        (lambda: gf.balance_by_time(2, funnel(), _sample(), warmup=-1), ValueError, "warmup"),
        (lambda: gf.balance_by_time(2, funnel(), _sample(), repeats=0), ValueError, "repeats"),
        (lambda: gf.balance_by_time(2, funnel(), _sample(), cost="fwd"), ValueError, "cost"),
        (lambda: gf.balance_by_time(2, funnel(), _sample(), timeout=-1), ValueError, "timeout"),
        (lambda: gf.balance_by_time(2, funnel(), _sample(), timeout="1"), TypeError, "timeout"),
        (
            lambda: gf.balance_by_time(2, funnel(), _sample(), timeout=math.inf),
            ValueError,
            "timeout",
        ),
        (
            lambda: gf.balance_by_time(2, funnel(), _sample(), repeats=3, timeout=1.0),
            TypeError,
            "repeats.*timeout.*not both",
        ),
        (lambda: gf.balance_by_size(2, funnel(), _sample(), chunks=0), ValueError, "chunks"),
        (lambda: gf.balance_by_size(2, funnel(), _sample(), chunks=2.5), TypeError, "chunks"),
        (lambda: gf.balance_by_time(2, funnel(), _sample(), device="tpu9"), ValueError, "device"),
        (lambda: gf.balance_by_size(2, funnel(), ()), TypeError, "sample"),
        (
            lambda: gf.balance_by_size(2, funnel(), _sample(), param_scale=-1),
            ValueError,
            "param_scale",
        ),
        (
            lambda: gf.balance_by_size(2, funnel(), _sample(), param_scale=math.nan),
            ValueError,
            "param_scale",
        ),
        (lambda: gf.plan(funnel(), _sample(), 2, 0), ValueError, "chunks must be >= 1"),
        (lambda: gf.plan(funnel(), _sample(), 2, 1.5), TypeError, "chunks must be an int"),
        (lambda: gf.plan(funnel(), _sample(), 2, 5), ValueError, r"chunks \(5\)"),
        (lambda: gf.plan(funnel(), _sample(), 2, 2, cost="flops"), ValueError, "cost"),
        (lambda: gf.plan(funnel(), _sample(), 2, 2, balance=[2, 2]), ValueError, "balance"),
        (lambda: gf.plan(funnel(), _sample(), 2, 2, balance=[5]), ValueError, "balance"),
        (lambda: gf.plan(funnel(), _sample(), 2, 2, balance=[5, 0]), ValueError, "balance"),
        (lambda: gf.plan(funnel(), _sample(), 2, 2, balance=[2.5, 2.5]), TypeError, "balance"),
        (lambda: gf.plan(funnel(), torch.tensor(1.0), 1, 1), ValueError, "sample"),
    ],
)
def test_bad_arguments(call, error: type[Exception], match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_device_without_cuda() -> None:
    with pytest.raises(ValueError, match="device"):
        gf.balance_by_time(2, funnel(), _sample(), device="cuda")


def test_layer_that_cannot_be_copied_is_named() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in favour of parametrizations, on purpose
        layer = torch.nn.utils.weight_norm(nn.Linear(4, 4))
    layer(torch.randn(2, 4))  # leaves a non-leaf `weight` attribute that deepcopy refuses
    with pytest.raises(TypeError, match=r"module\[1\] cannot be deep-copied"):
        gf.balance_by_size(2, nn.Sequential(nn.ReLU(), layer), torch.randn(2, 4))

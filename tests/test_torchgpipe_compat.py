"""torchgpipe 0.0.7 code runs on gpipe_fast with only its imports changed."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpipe_fast as gf

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only defaults")

# torchgpipe's README ("Usage"), verbatim.
README_EXAMPLE = """\
from torchgpipe import GPipe

model = nn.Sequential(a, b, c, d)
model = GPipe(model, balance=[1, 1, 1, 1], chunks=8)

for input in data_loader:
    output = model(input)
"""

# torchgpipe's user guide, "Input and Output Device", with the guide's own GPipe call.
GUIDE_DEVICES_EXAMPLE = """\
from torchgpipe import GPipe

model = GPipe(model, balance=[2, 2], chunks=8)

in_device = model.devices[0]
out_device = model.devices[-1]

for input, target in data_loader:
    # input on in_device
    input = input.to(in_device, non_blocking=True)

    # target on out_device
    target = target.to(out_device, non_blocking=True)

    # output on out_device
    output = model(input)
    loss = F.cross_entropy(output, target)
    loss.backward()
"""

# torchgpipe's user guide, "Automatic Balancing", and balance_by_size's docstring, with a
# CPU-sized sample and the partition count fixed (torch.cuda.device_count() is 0 on CPU).
GUIDE_BALANCE_EXAMPLE = """\
from torchgpipe import GPipe
from torchgpipe.balance import balance_by_size, balance_by_time

partitions = 2
sample = torch.rand(32, 3, 8, 8)
balance = balance_by_time(partitions, model, sample, timeout=0.2, device="cpu")
by_size = balance_by_size(partitions, model, sample, chunks=8, param_scale=4.0, device="cpu")

model = GPipe(model, balance, chunks=8)
"""


def as_gpipe_fast(source: str) -> str:
    """The torchgpipe source with its imports, and only those, pointed at gpipe_fast."""
    ported = source.replace("from torchgpipe import", "from gpipe_fast import").replace(
        "from torchgpipe.balance import", "from gpipe_fast.balance import"
    )
    changed = [
        (old, new)
        for old, new in zip(source.splitlines(), ported.splitlines(), strict=True)
        if old != new
    ]
    assert changed and all(old.startswith("from torchgpipe") for old, _ in changed)
    return ported


def run(source: str, **names: Any) -> dict[str, Any]:
    namespace: dict[str, Any] = {"torch": torch, "nn": nn, "F": F, **names}
    exec(compile(source, "<torchgpipe example>", "exec"), namespace)
    return namespace


def closed(namespace: dict[str, Any]) -> dict[str, Any]:
    """Joins the workers of the example's pipe (once its backward has run)."""
    model = namespace["model"]
    if isinstance(model, gf.GPipe):
        model.close()
    return namespace


def four_layers() -> tuple[nn.Module, ...]:
    return (
        nn.Linear(6, 16, dtype=torch.float64),
        nn.Tanh(),
        nn.Linear(16, 4, dtype=torch.float64),
        nn.Tanh(),
    )


def _readme_run(source: str) -> tuple[list[nn.Module], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    a, b, c, d = four_layers()
    data_loader = [torch.randn(16, 6, dtype=torch.float64) for _ in range(3)]
    reference = copy.deepcopy(nn.Sequential(a, b, c, d))
    names = run(source, a=a, b=b, c=c, d=d, data_loader=data_loader)
    names["output"].pow(2).sum().backward()
    closed(names)
    reference(data_loader[-1]).pow(2).sum().backward()
    torch.testing.assert_close(names["output"], reference(data_loader[-1]))
    for got, want in zip([a, c], [reference[0], reference[2]], strict=True):
        torch.testing.assert_close(got.weight.grad, want.weight.grad)
        torch.testing.assert_close(got.bias.grad, want.bias.grad)
    return [a, b, c, d], names["output"].detach(), a.weight.grad.clone()


@pytest.mark.parametrize("devices", ["default", "cpu x4"])
def test_readme_example_runs_with_only_the_import_changed(devices: str) -> None:
    source = as_gpipe_fast(README_EXAMPLE)
    if devices == "cpu x4":
        source = source.replace("chunks=8)", 'chunks=8, devices=["cpu"] * 4)')
    elif torch.cuda.is_available() and torch.cuda.device_count() < 4:
        pytest.skip("the default devices are the GPUs, and 4 cells need 4 of them")
    _readme_run(source)


def test_readme_example_matches_torchgpipe_itself() -> None:
    pytest.importorskip("torchgpipe")
    cpu_x4 = 'chunks=8, devices=["cpu"] * 4)'
    theirs = _readme_run(README_EXAMPLE.replace("chunks=8)", cpu_x4))
    ours = _readme_run(as_gpipe_fast(README_EXAMPLE).replace("chunks=8)", cpu_x4))
    torch.testing.assert_close(ours[1], theirs[1])
    torch.testing.assert_close(ours[2], theirs[2])


@no_cuda
def test_guide_device_example_trains() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*four_layers())
    reference = copy.deepcopy(model)
    data_loader = [(torch.randn(16, 6, dtype=torch.float64), torch.randint(4, (16,)))]
    names = closed(run(as_gpipe_fast(GUIDE_DEVICES_EXAMPLE), model=model, data_loader=data_loader))
    assert names["in_device"] == names["out_device"] == torch.device("cpu")
    input, target = data_loader[0]
    F.cross_entropy(reference(input), target).backward()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="the default devices are the GPUs, and 2 cells need 2 of them",
)
def test_guide_balance_example_takes_torchgpipes_keywords() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10), nn.ReLU()
    )
    names = closed(run(as_gpipe_fast(GUIDE_BALANCE_EXAMPLE), model=model))
    for balance in (names["balance"], names["by_size"]):
        assert len(balance) == 2 and sum(balance) == 5 and min(balance) >= 1
    assert names["model"].balance == names["balance"]


# -- torchgpipe's public-API behaviours ----------------------------------------------------------


def test_public_attributes_are_converted_as_torchgpipe_did() -> None:
    class MyString:
        def __init__(self, value: str) -> None:
            self.value = value

        def __str__(self) -> str:
            return self.value

    pipe = gf.GPipe(
        nn.Sequential(nn.Linear(1, 1)),
        balance=(1,),
        devices=("cpu",),
        chunks=42.000,  # type: ignore[arg-type]
        checkpoint=MyString("always"),  # type: ignore[arg-type]
    )
    assert pipe.balance == [1] and pipe.devices == [torch.device("cpu")]
    assert pipe.chunks == 42 and type(pipe.chunks) is int
    assert pipe.checkpoint == "always" and type(pipe.checkpoint) is str
    pipe.close()


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (lambda m: gf.GPipe(m, balance=[1, 1, 1, 1], devices=["cpu"]), IndexError),
        (lambda m: gf.GPipe(m, balance=[3]), ValueError),
        (lambda m: gf.GPipe(m, balance=[0, 4]), ValueError),
        (lambda m: gf.GPipe(m, balance=[-1, 5]), ValueError),
        (lambda m: gf.GPipe(m, balance=[4], chunks=0), ValueError),
        (lambda m: gf.GPipe(m, balance=[4], chunks=-1), ValueError),
        (lambda m: gf.GPipe(m, balance=[4], checkpoint="INVALID_CHECKPOINT"), ValueError),
        (lambda m: gf.GPipe(nn.Module(), balance=[1]), TypeError),
    ],
)
def test_bad_arguments_raise_what_torchgpipe_raised(build, error: type[Exception]) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error):
        build(nn.Sequential(*[nn.Linear(1, 1) for _ in range(4)]))


def test_empty_module_is_the_identity_on_any_tensor() -> None:
    pipe = gf.GPipe(nn.Sequential(), [])
    assert pipe(torch.tensor(42)) == torch.tensor(42)
    assert pipe((torch.tensor(42),)) == (torch.tensor(42),)
    with pytest.raises(TypeError):
        pipe(42)  # type: ignore[arg-type]
    pipe.close()


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_deferred_batch_norm_statistics_read_through_indexing(checkpoint: str) -> None:
    bn = nn.BatchNorm2d(3)
    pipe = gf.GPipe(
        nn.Sequential(copy.deepcopy(bn)),
        balance=[1],
        devices=["cpu"],
        chunks=2,
        checkpoint=checkpoint,
        deferred_batch_norm=True,
    )
    x = torch.rand(4, 3, 10, 10)
    pipe(x).mean().backward()
    bn(x).mean().backward()
    torch.testing.assert_close(pipe[0].running_mean, bn.running_mean)
    torch.testing.assert_close(pipe[0].running_var, bn.running_var)
    pipe.close()


def test_named_children_live_under_partitions() -> None:
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = gf.GPipe(nn.Sequential(OrderedDict([("a", a), ("b", b)])), [1, 1], devices=["cpu"] * 2)
    names = {name for name, _ in pipe.named_modules()}
    assert {"partitions.0.a", "partitions.1.b"} <= names
    with pytest.raises(AttributeError):
        pipe.a  # noqa: B018 - GPipe, unlike nn.Sequential, does not forward attributes
    pipe.close()


# -- what differs by design (docs/torchgpipe.md) ---------------------------------------------------


def test_state_dict_keeps_the_models_own_keys_and_loads_torchgpipes() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2))
    pipe = gf.GPipe(model, [2, 1], devices=["cpu", "cpu"])
    assert list(pipe.state_dict()) == list(model.state_dict())  # torchgpipe: partitions.0.0.*
    # A checkpoint torchgpipe saved with the same balance: keys "partitions.<cell>.<layer>...".
    saved = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2)).state_dict()
    theirs = {f"partitions.{0 if key[0] in '01' else 1}.{key}": v for key, v in saved.items()}
    assert "partitions.1.2.weight" in theirs
    pipe.load_state_dict(theirs)
    for key, value in saved.items():
        assert torch.equal(model.state_dict()[key], value), key
    pipe.close()


def test_balance_may_be_left_out() -> None:
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 64), nn.Linear(64, 4))
    pipe = gf.GPipe(model, devices=["cpu", "cpu"])  # torchgpipe: ValueError, balance required
    assert pipe.balance == gf.balance_by_params(2, model)
    pipe.close()


def test_profiling_a_model_with_gradients_leaves_them_alone() -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 1))
    sample = torch.rand(1, 3, 32, 32)
    model(sample).norm().backward()  # torchgpipe: ValueError, some parameter has a gradient
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    assert gf.balance_by_time(1, model, sample, timeout=0.05, device="cpu") == [1]
    for p, grad in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, grad)  # type: ignore[arg-type]

"""capture/cell.py: small forwards through gf.pipeline, exact against the plain model in float64
(values made between modules, read by two later stages, the glue's own tensors, a module two
stages call), and the run-time checks of every value that crosses: a value a stage's forward
makes otherwise than planned is an error naming it, never a misplaced value."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_capture_discover import _Fan, _Glue, _OwnTensors, _Shared
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

import gpipe_fast as gf

EXACT = 1e-13
CHUNKS = 3


def _square(out: Tensor, _: Any) -> Tensor:
    return out.square().mean()


def _check_exact(make: Callable[[], nn.Module], points: list[str], schedule: str = "1f1b") -> None:
    """train_step against the plain model on the whole batch: loss and every gradient."""
    torch.manual_seed(0)
    model = make().double()
    plain = copy.deepcopy(model)
    x = torch.randn(7, 4, dtype=torch.float64)
    stages = len(points) + 1
    devices = ["cpu"] * (stages // 2 if schedule == "zbv" else stages)
    pipe = gf.pipeline(model, x[:2], points, devices=devices, chunks=CHUNKS, schedule=schedule)
    try:
        loss = pipe.train_step(x, None, _square)
        want = _square(plain(x), None)
        want.backward()
        assert loss.item() == pytest.approx(want.item(), rel=EXACT)
        grads = dict(plain.named_parameters())
        names = [name for name, _ in pipe.named_parameters()]
        assert names == list(grads)  # the plain model's names, each once
        for name, param in pipe.named_parameters():
            want = grads[name].grad
            if want is None:  # a module the forward never calls
                assert param.grad is None, name
                continue
            assert torch.allclose(param.grad, want, rtol=EXACT, atol=1e-15), name
    finally:
        pipe.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbv"])
def test_a_value_made_between_modules(schedule: str) -> None:
    _check_exact(_Glue, ["b"], schedule)


def test_a_value_read_by_two_later_stages() -> None:
    _check_exact(_Fan, ["b", "c"])


def test_the_glues_own_parameter_read_on_two_stages_and_its_buffer() -> None:
    _check_exact(_OwnTensors, ["b"])


def test_a_module_two_stages_call() -> None:
    _check_exact(_Shared, ["middle"])


def test_the_glues_own_parameter_on_two_devices_is_a_replica_summed_as_ties_are() -> None:
    # Two CPU "devices" of one process: the stages hold the parameter apart when they differ;
    # here both are the CPU, so one tensor serves both (the tie is the same object).
    torch.manual_seed(0)
    model = _OwnTensors().double()
    pipe = gf.pipeline(model, torch.randn(2, 4, dtype=torch.float64), ["b"],
                       devices=["cpu", "cpu"], chunks=2)  # fmt: skip
    try:
        held = [dict(cell.named_parameters()) for cell in pipe.partitions]
        assert held[0]["stage0.scale"] is held[1]["stage1.scale"] is model.scale
        assert set(pipe.state_dict()) == set(model.state_dict())
    finally:
        pipe.close()


class _Repeats(nn.Module):
    """Glue whose run differs on a placeholder: it repeats the rows once more on a fake."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h = h.repeat(3 if isinstance(h, FakeTensor) else 2, 1)  # the same op, other shapes
        return self.b(h)


def test_a_value_received_with_other_shapes_than_the_stage_makes_is_an_error_naming_it() -> None:
    pipe = gf.pipeline(_Repeats().double(), torch.randn(2, 4, dtype=torch.float64), ["b"],
                       devices=["cpu", "cpu"], chunks=2)  # fmt: skip
    try:
        with pytest.raises(RuntimeError, match=r"stage 1 received the output of repeat after "
                           r"'a' \(call 0\) as \(4, 4\).*makes \(6, 4\)"):  # fmt: skip
            pipe.train_step(torch.randn(4, 4, dtype=torch.float64), None, _square)
    finally:
        pipe.close()


class _Skips(nn.Module):
    """Glue that takes another path on real tensors than on fakes: the value planned is not
    made on the stage that must send it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h = torch.tanh(h) if isinstance(h, FakeTensor) else torch.sigmoid(h)
        return self.b(h)


def test_a_value_the_producer_does_not_make_is_an_error_naming_it() -> None:
    pipe = gf.pipeline(_Skips().double(), torch.randn(2, 4, dtype=torch.float64), ["b"],
                       devices=["cpu", "cpu"], chunks=2)  # fmt: skip
    try:
        with pytest.raises(RuntimeError, match=r"stage 0's run of the model's forward ended "
                           r"without making the output of tanh after 'a' \(call 0\)"):  # fmt: skip
            pipe.train_step(torch.randn(4, 4, dtype=torch.float64), None, _square)
    finally:
        pipe.close()


class _Reads(nn.Module):
    """Glue that reads values on the host after planning (as a hook's .item() on a module that
    spans stages would): a's output, which stage 1 receives or not."""

    def __init__(self, routed: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.routed = routed
        self.read = False
        self.seen: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.read:
            self.seen.append(h.abs().max().item())
        return self.b(h if self.routed else x)


def test_glue_reading_a_value_its_stage_receives_reads_the_real_one() -> None:
    model = _Reads(routed=True).double()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe = gf.pipeline(model, x[:2], ["b"], devices=["cpu", "cpu"], chunks=2)
    model.read = True  # after planning: the plan never saw the read
    try:
        loss = pipe.train_step(x, None, _square)
        assert loss.item() == pytest.approx(_square(plain(x), None).item(), rel=EXACT)
        # On the stage that receives it, each micro-batch's own (stage 0 stops once a's output
        # is taken, before the read); a(x) of the micro-batch, as the pipe computes it: a's
        # rows of the whole batch may differ in their last bit (BLAS blocks 4 rows otherwise).
        want = {plain.a(part).abs().max().item() for part in x.split(2)}
        assert model.seen and set(model.seen) == want
    finally:
        pipe.close()


def test_a_stage_reading_the_values_of_a_placeholder_is_an_error_naming_where() -> None:
    model = _Reads(routed=False).double()
    pipe = gf.pipeline(model, torch.randn(2, 4, dtype=torch.float64), ["b"],
                       devices=["cpu", "cpu"], chunks=2)  # fmt: skip
    model.read = True
    try:
        with pytest.raises(RuntimeError, match=r"on stage 1 the model's forward reads the "
                           r"values of a tensor inside 'the model' \(its forward or a hook of "
                           r"it\) after 'a' \(call 0\) was called"):  # fmt: skip
            pipe.train_step(torch.randn(4, 4, dtype=torch.float64), None, _square)
    finally:
        pipe.close()


def test_a_forward_calling_its_modules_in_another_order_is_an_error_naming_both() -> None:
    class Swaps(_Glue):
        swap = False

        def forward(self, x: Tensor) -> Tensor:
            first, second = (self.b, self.a) if self.swap else (self.a, self.b)
            return second(first(x))

    model = Swaps().double()
    pipe = gf.pipeline(model, torch.randn(2, 4, dtype=torch.float64), ["b"],
                       devices=["cpu", "cpu"], chunks=2)  # fmt: skip
    model.swap = True
    try:
        with pytest.raises(RuntimeError, match=r"called 'b' where its plan has 'a' \(call 0\)"):
            pipe.train_step(torch.randn(4, 4, dtype=torch.float64), None, _square)
    finally:
        pipe.close()


def own_tensors_across(rank: int, world: int) -> dict[str, Any]:
    """A Cluster case: _OwnTensors at pp=2, whose glue parameter both ranks read: this rank's
    gradients by name, and the plain model's."""
    from dist_cases import groups

    pp_group, _, _ = groups(2, 1)
    torch.manual_seed(0)
    model = _OwnTensors().double()
    plain = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pipe = gf.pipeline(model, x[:2], ["b"], chunks=CHUNKS, schedule="1f1b", pp_group=pp_group,
                       timeout=60)  # fmt: skip
    try:
        loss = pipe.train_step(x, None, _square)
    finally:
        pipe.close()
    _square(plain(x), None).backward()
    return {
        "loss": loss.item(),
        "plain": _square(plain(x), None).item(),
        "grads": {n: p.grad.tolist() for n, p in pipe.named_parameters()},
        "want": {n: p.grad.tolist() for n, p in plain.named_parameters()},
    }


def test_the_glues_own_parameter_read_on_two_ranks_is_tied_across_them(two: Any) -> None:
    from cluster import values

    ranks = values(two.run("test_capture_cell.own_tensors_across"))
    assert {n for r in ranks for n in r["grads"]} == set(ranks[0]["want"])
    assert "scale" in ranks[0]["grads"] and "scale" in ranks[1]["grads"]
    for got in ranks:
        assert got["loss"] == pytest.approx(got["plain"], rel=EXACT)
        for name, grad in got["grads"].items():
            torch.testing.assert_close(torch.tensor(grad), torch.tensor(got["want"][name]),
                                       rtol=EXACT, atol=1e-15)  # fmt: skip


class _Twin(nn.Module):
    """Returns its input as it is beside its result, as MobileBERT's bottleneck does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.lin(x), x


class _PassesOn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.twin, self.c = nn.Linear(4, 4), _Twin(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        y, same = self.twin(h)
        return self.c(y + same) * h  # the input passed on and the original: one value


def test_a_module_passing_its_input_on_gives_the_same_value_on_every_stage() -> None:
    _check_exact(_PassesOn, ["c"])


class _Biased(nn.Module):
    """Makes a bias the first time (by a module of its own), then returns the one it is
    given as it got it: T5's position bias, passed from block to block."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.make = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if bias is None:
            bias = self.make(x)
        return self.lin(x) + bias, bias


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Biased() for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        bias = None
        for block in self.blocks:
            x, bias = block(x, bias)
        return x


@pytest.mark.parametrize("points", [["blocks.2"], ["blocks.1", "blocks.2"]])
def test_a_value_passed_on_from_module_to_module_is_the_one_first_made(points: list[str]) -> None:
    _check_exact(_Chain, points)


class _Twice(nn.Module):
    """Returns one tensor at two places of its output (T5Gemma's last hidden state is also
    its decoder_hidden_states)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        h = torch.tanh(self.lin(x))
        return {"first": h, "again": h}


class _ReadsOne(nn.Module):
    def __init__(self, key: str) -> None:
        super().__init__()
        self.key, self.inner, self.head = key, _Twice(), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inner(x)[self.key] * 2)


@pytest.mark.parametrize("key", ["first", "again"])
def test_a_tensor_an_atom_returns_at_two_places_is_one_value(key: str) -> None:
    _check_exact(lambda: _ReadsOne(key), ["head"])

"""Pytrees between cells (dicts, tuples holding None, namedtuples; ints, bools, strings): every
schedule and checkpoint mode equals the plain nn.Sequential on the whole batch, in one process
and across two (over shared memory and over gloo, bit for bit alike)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import pytree_cases as cases
import torch
from cluster import Cluster, values
from torch import nn
from transport_cases import CHECKPOINTS

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.skip import pop, skippable, stash

KINDS = {kind.name: kind.stages_per_worker for kind in _C.schedule_kinds() if not kind.registered}
MODES = ("never", "except_last", "always")
SEED = 5
TOLERANCE = {"rtol": 1e-12, "atol": 1e-13}


def _reference(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """The plain model on the whole batch: output, loss, and every gradient (x's too)."""
    net = cases.model(SEED)
    x = x.detach().clone().requires_grad_()
    out = net(x)
    loss = cases.loss_fn(out, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return {"out": out, "loss": loss.detach(), "x_grad": x.grad, "grads": grads}


def _assert_grads(pipe: gf.GPipe, want: dict[str, torch.Tensor], what: str) -> None:
    got = {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys(), what
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, **TOLERANCE, msg=f"{what}: {name}")


def _pipe(make_pipe: Any, schedule: str, checkpoint: str, chunks: int = 4) -> gf.GPipe:
    devices = ["cpu"] * (2 if KINDS[schedule] == 2 else 4)
    return make_pipe(  # type: ignore[no-any-return]
        cases.model(SEED), [2, 2, 2, 2], devices=devices, chunks=chunks, schedule=schedule,
        checkpoint=checkpoint,
    )  # fmt: skip


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", list(KINDS))
def test_train_step_equals_the_plain_model(make_pipe: Any, schedule: str, checkpoint: str) -> None:
    pipe = _pipe(make_pipe, schedule, checkpoint)
    for step, size in enumerate([11, 8]):  # uneven micro-batches, then even ones
        x, y = cases.batch(size, step)
        want = _reference(x, y)
        pipe.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_()
        loss = pipe.train_step(x, y, cases.loss_fn)
        what = f"{schedule}, {checkpoint}, step {step}"
        torch.testing.assert_close(loss, want["loss"], **TOLERANCE, msg=what)
        torch.testing.assert_close(x.grad, want["x_grad"], **TOLERANCE, msg=what)
        _assert_grads(pipe, want["grads"], what)
        assert pipe.eval_step(x, y, cases.loss_fn).item() == pytest.approx(
            want["loss"].item(), rel=1e-12
        )


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", list(KINDS))
def test_pipe_call_and_backward_equal_the_plain_model(
    make_pipe: Any, schedule: str, checkpoint: str
) -> None:
    pipe = _pipe(make_pipe, schedule, checkpoint)
    x, y = cases.batch(11, 0)
    want = _reference(x, y)
    x = x.clone().requires_grad_()
    out = pipe(x)
    # The output is gathered leaf by leaf: tensors joined along dim 0, the int kept.
    assert type(out) is dict and out.keys() == want["out"].keys() and out["k"] == 2
    torch.testing.assert_close(out["y"], want["out"]["y"], **TOLERANCE)
    assert torch.equal(out["mask"], want["out"]["mask"]) and not out["mask"].requires_grad
    cases.loss_fn(out, y).backward()
    torch.testing.assert_close(x.grad, want["x_grad"], **TOLERANCE)
    _assert_grads(pipe, want["grads"], checkpoint)
    with torch.no_grad():
        out = pipe(x)
    torch.testing.assert_close(out["y"], want["out"]["y"], **TOLERANCE)


def test_a_non_tensor_output_that_differs_between_micro_batches_is_named(make_pipe: Any) -> None:
    # "rows" is each micro-batch's own size: it cannot be one value of the whole batch.
    pipe = make_pipe(cases.model(SEED)[:4], [2, 2], devices=["cpu"] * 2, chunks=3)
    x, _ = cases.batch(11, 0)
    with pytest.raises(ValueError, match=r"output\['rows'\] is 4 in micro-batch 0 but 3"):
        pipe(x)


def test_a_list_between_cells_is_passed_whole(make_pipe: Any) -> None:
    # A layer gets what the layer before returned as one argument (nn.Sequential's way).
    class Listed(nn.Module):
        def forward(self, x: torch.Tensor) -> list[Any]:
            return [x, x * 2, "two"]

    class Summed(nn.Module):
        def forward(self, pair: list[Any]) -> torch.Tensor:
            assert type(pair) is list and pair[2] == "two"
            return pair[0] + pair[1]

    module = nn.Sequential(nn.Linear(3, 3), Listed(), Summed(), nn.Linear(3, 3)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    want = copy.deepcopy(module)(x)
    for schedule in ("gpipe", "zero_bubble"):
        pipe = make_pipe(copy.deepcopy(module), [2, 2], devices=["cpu"] * 2, schedule=schedule)
        torch.testing.assert_close(pipe(x), want, **TOLERANCE)
        pipe.train_step(x, want, nn.functional.mse_loss)


def test_a_skip_across_cells_holding_a_dict_is_refused_by_name(make_pipe: Any) -> None:
    @skippable(stash=["extra"])
    class Stash(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            yield stash("extra", {"x": x})
            return x

    @skippable(pop=["extra"])
    class Pop(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            extra = yield pop("extra")
            return x + extra["x"]

    pipe = make_pipe(nn.Sequential(Stash(), Pop()), [1, 1], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match=r"skip 'extra' stashed in cell 0 is a dict"):
        pipe(torch.randn(4, 2))


# -- across processes ----------------------------------------------------------------------

# Which boundary crosses: [2, 6] the tuple with None, [4, 4] the dict, [3, 5] the Pair (and
# the other two between a zero_bubble cell's layers); two cells per rank: all three.
BALANCES = {"gpipe": [2, 6], "1f1b": [4, 4], "zero_bubble": [3, 5]}
BATCHES = [7, 12]  # uneven, then even micro-batches (chunks=3)


@pytest.mark.parametrize("schedule", list(KINDS))
def test_pytrees_across_processes_equal_the_plain_model(two: Cluster, schedule: str) -> None:
    balance = BALANCES.get(schedule, [2, 2, 2, 2])
    results = values(two.run("pytree_cases.both_transports", schedule=schedule,
                             balance=balance, batches=BATCHES, seed=SEED))  # fmt: skip
    assert all(r["poisoned"] for r in results), "the suite's rings run poisoned"
    wanted = [_reference(*cases.batch(size, step)) for step, size in enumerate(BATCHES)]
    for checkpoint in CHECKPOINTS:
        shm = [r["runs"][f"{checkpoint} shared memory"] for r in results]
        gloo = [r["runs"][f"{checkpoint} gloo"] for r in results]
        assert shm == gloo, f"{checkpoint}: shared memory and gloo differ"
        for step, want in enumerate(wanted):
            seen: set[str] = set()
            for rank, run in enumerate(shm):
                got = run["steps"][step]
                what = f"{checkpoint}, rank {rank}, step {step}"
                assert got["loss"] == pytest.approx(want["loss"].item(), rel=1e-12), what
                for name, grad in got["grads"].items():
                    torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64),
                                               want["grads"][name], **TOLERANCE,
                                               msg=f"{what}, {name}")  # fmt: skip
                    seen.add(name)
            assert seen == set(want["grads"]), (checkpoint, step)
            torch.testing.assert_close(torch.tensor(shm[0]["steps"][step]["x_grad"],
                                                    dtype=torch.float64),
                                       want["x_grad"], **TOLERANCE)  # fmt: skip
        first = wanted[0]
        assert all(run["eval"] == pytest.approx(first["loss"].item(), rel=1e-12) for run in shm)
        # pipe(x) gives the output on the last cell's rank (rank 0 in zbv's V), None elsewhere.
        outputs = [run["output"] for run in shm if run["output"] is not None]
        assert len(outputs) == 1, [run["output"] is None for run in shm]
        output = outputs[0]
        assert output["k"] == 2 and output["mask"] == first["out"]["mask"].tolist()
        torch.testing.assert_close(torch.tensor(output["y"], dtype=torch.float64),
                                   first["out"]["y"].detach(), **TOLERANCE)  # fmt: skip


def test_the_balancing_helpers_profile_layers_that_pass_pytrees() -> None:
    # They feed the sample through the layers as the pipe does: a layer's output, whatever
    # its structure, is the next one's input; its bytes are those of its tensors.
    net = cases.model(SEED)
    x, _ = cases.batch(8, 0)
    sizes = gf.balancing.profile.layer_output_bytes(net, x)
    assert sizes[0] == x.numel() * 8 + x.numel()  # "h" (float64) and "mask" (bool)
    assert len(gf.balance_by_time(2, net, x, repeats=1, warmup=0)) == 2
    assert len(gf.balance_by_size(2, net, x)) == 2
    plan = gf.plan(net, x, 2, 4, cost="time", schedule="zero_bubble")
    assert sum(plan.balance) == len(net)

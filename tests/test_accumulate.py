"""Gradients left to accumulate over several train_steps (no zero_grad between them): exact
against the plain model doing the same steps, with dp_group, ties within and across ranks,
pp x dp, every schedule, clipping after them; a failed step leaves them as they were."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from accumulate_cases import BATCHES, accumulation, tied_balance
from cluster import Cluster, values
from dist_cases import cross_entropy, tied_model, tokens
from torch import nn

from gpipe_fast.distributed.held_gradients import summing_this_step_only
from gpipe_fast.schedule.registry import builtin_schedules

SCHEDULES = builtin_schedules()

STEPS: dict[str, Any] = {"accumulated": 3, "restarted": 2, "max_norm": 0.05}


def plain() -> dict[str, Any]:
    """The whole model doing the same steps on the whole batches."""
    net = tied_model()

    def train(i: int) -> None:
        x, y = tokens(BATCHES[i], seed=100 + i)
        cross_entropy(net(x), y).backward()

    def clip(max_norm: float) -> torch.Tensor:
        return nn.utils.clip_grad_norm_(net.parameters(), max_norm)

    return accumulation(net, train, clip, **STEPS)


def labelled(where: str) -> Callable[[str], str]:
    """assert_close's message, prefixed by where it failed."""
    return lambda message: f"{where}: {message}"


def float64(values: list[Any]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def check(results: list[dict[str, Any]], want: dict[str, Any]) -> None:
    """Every rank's gradients after every step, and its norm, are the plain model's; each
    parameter is on some rank."""
    assert want["norm"] > STEPS["max_norm"], "the clip scales the gradients"
    seen: set[str] = set()
    for rank, got in enumerate(results):
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-12), rank
        steps = [*got["from_none"], got["clipped"], *got["from_zeros"]]
        wanted = [*want["from_none"], want["clipped"], *want["from_zeros"]]
        for step, (grads, reference) in enumerate(zip(steps, wanted, strict=True)):
            for name, grad in grads.items():
                torch.testing.assert_close(
                    float64(grad), float64(reference[name]), rtol=1e-12, atol=1e-14,
                    msg=labelled(f"rank {rank}, step {step}, {name}"),
                )  # fmt: skip
            seen |= set(grads)
    assert seen == set(want["clipped"]), "every parameter's gradient is on some rank"


def test_a_step_sums_its_own_gradients_then_adds_the_held_ones() -> None:
    # The step sees no gradient (its backward writes fresh ones, its sums see only those);
    # after it, held + fresh in the held tensor, as the autograd engine accumulates; a
    # failed step gives back what it found.
    held_one, none = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    held = held_one.grad = torch.randn(4)
    was = held.clone()
    fresh = torch.randn(4)
    with summing_this_step_only([held_one, none]):
        assert held_one.grad is None and none.grad is None
        held_one.grad, none.grad = fresh.clone(), fresh.clone()
    assert held_one.grad is held and torch.equal(held, was + fresh)
    assert none.grad is not None and torch.equal(none.grad, fresh)
    with pytest.raises(KeyError), summing_this_step_only([held_one, none]):
        held_one.grad = none.grad = torch.randn(4)
        raise KeyError("a failed step")
    assert held_one.grad is held and torch.equal(held, was + fresh)
    assert torch.equal(none.grad, fresh)


# pipe(x) runs fill-drain whatever the schedule: once is enough.
ONE_PROCESS = [("train_step", s) for s in SCHEDULES] + [("pipe(x) and backward", "gpipe")]


@pytest.mark.parametrize(("path", "schedule"), ONE_PROCESS)
def test_in_one_process_the_tied_weight_accumulates(
    make_pipe: Any, path: str, schedule: str
) -> None:
    # Embedding and head in the first and last cells of one process: the autograd engine
    # adds both uses into the one tensor, step after step.
    pipe = make_pipe(tied_model(), tied_balance(schedule), devices=["cpu"] * 2, chunks=3,
                     schedule=schedule)  # fmt: skip

    def train(i: int) -> None:
        x, y = tokens(BATCHES[i], seed=100 + i)
        if path == "train_step":
            pipe.train_step(x, y, cross_entropy)
        else:
            cross_entropy(pipe(x), y).backward()

    check([accumulation(pipe, train, pipe.clip_grad_norm_, **STEPS)], plain())


# (processes, pp, dp). The tied embedding and head are in the first and last cells: with dp
# alone in one process per replica; with pp on two ranks, but on rank 0 alone under zbv (V).
LAYOUTS = {
    "dp alone": (2, 1, 2),
    "pp": (2, 2, 1),
    "pp x dp": (4, 2, 2),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_steps_accumulate_across_processes(
    two: Cluster, four: Cluster, layout: str, schedule: str
) -> None:
    # Each step's sums over dp_group and over the tied copies add this step's gradient to
    # the one held, once: after k steps every rank holds the plain model's k-step sum.
    processes, pp, dp = LAYOUTS[layout]
    cluster = two if processes == 2 else four
    results = values(cluster.run("accumulate_cases.accumulate", schedule=schedule, pp=pp, dp=dp,
                                 **STEPS))  # fmt: skip
    check(results, plain())


def test_a_failed_step_leaves_the_gradients_it_found(two: Cluster) -> None:
    # dp_group alone: rank 0's backward raises after cell 1's gradients were summed; both
    # ranks end with the gradients of the step before, none half summed.
    replies = values(two.run("accumulate_cases.failed_accumulation", timeout_s=60))
    two.reset()  # a failed step leaves the process group to be rebuilt (docs/processes.md)
    assert [reply["error"] for reply in replies] == ["RuntimeError", "PeerFailure"]
    for reply in replies:
        assert reply["before"] and reply["after"] == reply["before"]

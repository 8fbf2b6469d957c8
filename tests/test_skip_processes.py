"""Skip connections between processes: a skip's own messages, past the cells in between,
on every schedule and checkpoint mode, equal to the plain nn.Sequential."""

from __future__ import annotations

from typing import Any

import dist_cases
import pytest
import torch
from cluster import Cluster, values
from skip_models import SCENARIOS, dropout
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C

BATCHES = [7, 12]  # uneven, then even micro-batches (chunks=3)
# 2 ranks: one cell each (K=2), or two (K=4: interleaved's 0,2 | 1,3 and zbv's 0,3 | 1,2,
# where some skips join two cells of one rank and others cross).
LAYOUTS = {
    "gpipe": [3, 3],
    "1f1b": [3, 3],
    "zero_bubble": [3, 3],
    "interleaved": [2, 1, 1, 2],
    "zbv": [2, 1, 1, 2],
}


def _reference(scenario: str, seed: int, size: int, step: int) -> tuple[float, dict[str, Any]]:
    """The scenario's plain nn.Sequential on the whole batch: loss and gradients by name."""
    torch.manual_seed(seed)
    net = SCENARIOS[scenario]().double()
    x, y = dist_cases.batch(size, seed=300 + step)
    loss = nn.functional.mse_loss(net(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}


def _check(results: list[dict[str, Any]], scenario: str, seed: int) -> None:
    for step, size in enumerate(BATCHES):
        loss, grads = _reference(scenario, seed, size, step)
        seen: set[str] = set()
        for rank, result in enumerate(results):
            got = result["steps"][step]
            assert got["loss"] == pytest.approx(loss, rel=1e-12), (rank, step)
            assert got["eval"] == pytest.approx(loss, rel=1e-12), (rank, step)
            for name, grad in got["grads"].items():
                torch.testing.assert_close(
                    torch.tensor(grad, dtype=torch.float64), grads[name], rtol=1e-10, atol=1e-12,
                    msg=f"rank {rank}, step {step}, {name}",
                )  # fmt: skip
                assert name not in seen, f"{name} on two ranks"
                seen.add(name)
        assert seen == set(grads), "every parameter's gradient is on some rank"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("schedule", list(LAYOUTS))
def test_skips_between_two_processes_equal_the_plain_sequential(
    two: Cluster, schedule: str, scenario: str
) -> None:
    seed = len(scenario) + len(schedule)
    results = values(
        two.run("skips", scenario=scenario, schedule=schedule, checkpoint="except_last",
                balance=LAYOUTS[schedule], batches=BATCHES, seed=seed)
    )  # fmt: skip
    _check(results, scenario, seed)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_every_checkpoint_mode_across_processes(
    two: Cluster, schedule: str, checkpoint: str
) -> None:
    results = values(
        two.run("skips", scenario="multi", schedule=schedule, checkpoint=checkpoint,
                balance=LAYOUTS[schedule], batches=BATCHES, seed=4)
    )  # fmt: skip
    _check(results, "multi", 4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_skips_over_processes_in_between(four: Cluster, schedule: str) -> None:
    # Four ranks, a cell each: "across" goes from rank 0 straight to rank 3.
    for scenario in ("across", "multi"):
        results = values(
            four.run("skips", scenario=scenario, schedule=schedule, checkpoint="except_last",
                     balance=[2, 1, 1, 2], batches=BATCHES, seed=9)
        )  # fmt: skip
        _check(results, scenario, 9)


def _program(kind: str, stages: int, ranks: list[int], skips: list[tuple[int, int]]) -> Any:
    program, worker_rank = _C.lowered_program(
        kind, stages, len(ranks), 4, "except_last", ranks, False, skips=skips
    )
    return program, worker_rank


def test_a_skip_between_ranks_is_its_own_send_and_receive() -> None:
    program, worker_rank = _program("1f1b", 4, [0, 1, 2, 3], [(0, 3)])
    tasks = {(w, a, s, m) for w, order in enumerate(program) for a, s, m in order}
    for m in range(4):
        # Sent after cell 0's forward, received on rank 3 only: not through ranks 1 and 2.
        assert any(a == "send_skips" and s == 0 and m2 == m for _, a, s, m2 in tasks)
        receivers = {worker_rank[w] for w, a, s, m2 in tasks if a == "recv_skips" and m2 == m}
        assert receivers == {3}
        back = {worker_rank[w] for w, a, s, m2 in tasks if a == "recv_skip_grads" and m2 == m}
        assert back == {0}
    # Each send follows the forward that stashed it, on the same worker.
    order = program[0]
    for i, (action, stage, m) in enumerate(order):
        if action == "send_skips":
            assert ("forward", stage, m) in order[:i]


def test_skips_within_one_rank_need_no_messages() -> None:
    # zbv on 2 ranks: stages 0 and 3 on rank 0, so a skip 0 -> 3 stays in memory.
    program, _ = _program("zbv", 4, [0, 1], [(0, 3)])
    actions = {a for order in program for a, _, _ in order}
    assert not actions & {"send_skips", "recv_skips", "send_skip_grads", "recv_skip_grads"}


PAIRED = (("send_skips", "recv_skips"), ("send_skip_grads", "recv_skip_grads"))


def _messages(
    program: Any,
    worker_rank: list[int],
    rank_of: list[int],
    skips: list[tuple[int, int]],
    action: str,
    here: int,
    there: int,
) -> list[tuple[int, int, int]]:
    """The skip messages between ranks `here` and `there`, as (stash, pop, micro-batch), in
    the order rank `here`'s tasks of `action` send or receive them (a task carries one
    message per pair of the other rank, pairs in order)."""
    out = []
    for worker, order in enumerate(program):
        if worker_rank[worker] != here:
            continue
        for name, stage, m in order:
            if name != action:
                continue
            for s, p in sorted(skips):
                other = p if stage == s else s if stage == p else None
                if other is not None and rank_of[other] == there:
                    if (action in ("send_skips", "recv_skip_grads")) == (stage == s):
                        out.append((s, p, m))
    return out


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv"])
def test_the_dry_run_covers_skips_and_each_pair_keeps_one_order(kind: str) -> None:
    stages = 4
    workers = 2 if kind in ("interleaved", "zbv") else 4
    ranks = list(range(workers))
    skips = [(0, 3), (0, 2), (1, 3), (0, 1)]
    for rank in ranks:  # each rank's schedule, built once every rank's passed the dry run
        schedule = _C.rank_schedule(kind, stages, workers, 4, "except_last", ranks, False, rank,
                                    skips=skips)  # fmt: skip
        assert any(schedule.tasks)
    program, worker_rank = _program(kind, stages, ranks, skips)
    placement = _C.placement(kind, stages, workers)
    rank_of = [worker_rank[placement[s]] for s in range(stages)]
    crossing = 0
    for a in ranks:
        for b in ranks:
            if a == b:
                continue
            for send, recv in PAIRED:
                # Per skip pair, the micro-batches go in one order on both sides (one task
                # may receive several pairs at once: it posts them all, then waits).
                sent = _messages(program, worker_rank, rank_of, skips, send, a, b)
                received = _messages(program, worker_rank, rank_of, skips, recv, b, a)
                assert sorted(sent) == sorted(received), (a, b, send)
                for pair in {(s, p) for s, p, _ in sent}:
                    per_pair = [m for s, p, m in sent if (s, p) == pair]
                    assert per_pair == [m for s, p, m in received if (s, p) == pair]
                crossing += len(sent)
    assert crossing > 0


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_many_steps_with_skips_between_processes_leave_nothing_behind(
    two: Cluster, schedule: str
) -> None:
    for result in values(two.run("skips_soak", schedule=schedule, steps=300)):
        before, after = result["counts"]
        assert after == before, result  # (live tensors, threads) after warm-up and at the end


def test_dropout_in_a_stashing_cell_is_replayed_across_processes(two: Cluster) -> None:
    # The stashing cell's recomputation ("always") re-stashes the same dropped-out values
    # as its forward did ("never"), and both equal the pipe in one process seeded alike.
    runs = {}
    for checkpoint in ("never", "always"):
        runs[checkpoint] = values(
            two.run("skips", scenario="dropout", schedule="1f1b", checkpoint=checkpoint,
                    balance=[3, 3], batches=BATCHES, seed=6, step_seed=1234)
        )  # fmt: skip
    torch.manual_seed(6)
    model = dropout().double()
    pipe = gf.GPipe(model, [3, 3], devices=["cpu", "cpu"], chunks=3, schedule="1f1b")
    try:
        for step, size in enumerate(BATCHES):
            x, y = dist_cases.batch(size, seed=300 + step)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1234 + step)
            loss = pipe.train_step(x, y, nn.functional.mse_loss).item()
            grads = dict(pipe.state_dict(keep_vars=True))
            for checkpoint, results in runs.items():
                assert results[1]["steps"][step]["loss"] == pytest.approx(loss, rel=1e-12)
                for result in results:
                    for name, grad in result["steps"][step]["grads"].items():
                        torch.testing.assert_close(
                            torch.tensor(grad, dtype=torch.float64), grads[name].grad,
                            rtol=1e-10, atol=1e-12, msg=f"{checkpoint}, step {step}, {name}",
                        )  # fmt: skip
            # Dropout did drop: not the loss of the model in evaluation mode.
            with torch.no_grad():
                assert loss != pytest.approx(
                    nn.functional.mse_loss(model.eval()(x), y).item(), rel=1e-6
                )
            model.train()
    finally:
        pipe.close()

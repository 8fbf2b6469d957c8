"""Stages sharded over their data-parallel group (dp_shard, FSDP2): every whole gradient
against the plain model on the whole batch, for every schedule and policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dcp_cases
import dist_cases
import pytest
import torch
from cluster import Cluster, values
from torch import nn

from gpipe_fast.schedule.registry import builtin_schedules

SCHEDULES = builtin_schedules()
Ties = tuple[tuple[int, int], ...]


def _reference(
    layers: int, sizes: list[int], accumulate: bool, ties: Ties = ()
) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Per step, the plain model's loss and gradients on the whole batch (summed over the
    steps so far when `accumulate`), a tied weight's under each of its names."""
    net = dist_cases.model(layers, ties=ties)
    out = []
    for step, size in enumerate(sizes):
        if not accumulate:
            net.zero_grad(set_to_none=True)
        x, y = dist_cases.batch(size, seed=100 + step)
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        named = net.named_parameters(remove_duplicate=False)
        out.append((loss.item(), {n: p.grad.clone() for n, p in named}))  # type: ignore[union-attr]
    return out


def _check(results: list[dict[str, Any]], layers: int, sizes: list[int], dp: int,
           accumulate: bool = False, ties: Ties = (), rtol: float = 1e-10) -> None:  # fmt: skip
    reference = _reference(layers, sizes, accumulate, ties)
    for step, (loss, grads) in enumerate(reference):
        seen = set()
        for rank, result in enumerate(results):
            got = result["steps"][step]
            assert got["loss"] == pytest.approx(loss, rel=rtol), (rank, step)
            for name, grad in got["grads"].items():
                seen.add(name)
                torch.testing.assert_close(
                    torch.tensor(grad, dtype=torch.float64), grads[name], rtol=rtol,
                    atol=rtol / 100, msg=f"rank {rank}, step {step}, {name}",
                )  # fmt: skip
        assert seen == set(grads), "every gradient is somewhere"
    for result in results:  # every parameter is a shard: half a Linear's tensors, or so
        for name, (kind, local) in result["local"].items():
            assert kind == "DTensor", name
            whole = dist_cases.model(layers).get_parameter(name).numel()
            assert local <= -(-whole // dp) + dist_cases.WIDTH, (name, local, whole)


def _train(cluster: Cluster, **kwargs: Any) -> list[dict[str, Any]]:
    return values(cluster.run("sharded_cases.train", **kwargs))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("sync", ["per_microbatch", "per_step"])
def test_pp_by_sharded_dp_every_schedule(four: Cluster, schedule: str, sync: str) -> None:
    cells = 4 if schedule in ("interleaved", "zbv") else 2
    sizes = [16, 11]  # even, then uneven micro-batches
    results = _train(four, schedule=schedule, layers=4, balance=[8 // cells] * cells, chunks=3,
                     checkpoint="except_last", batches=sizes, pp=2, dp=2, sync=sync)  # fmt: skip
    _check(results, 4, sizes, dp=2)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble"])
def test_sharded_dp_alone_every_checkpoint_mode(
    two: Cluster, schedule: str, checkpoint: str
) -> None:
    sizes = [10, 7]
    results = _train(two, schedule=schedule, layers=4, balance=[4, 4], chunks=3,
                     checkpoint=checkpoint, batches=sizes, pp=1, dp=2)  # fmt: skip
    _check(results, 4, sizes, dp=2)


# (schedule, checkpoint, sync, reshard_after_forward) -> (all-gathers, reduce-scatters) per
# FSDP unit of a stage in a step of M micro-batches (the guide's table): each task that
# runs a unit gathers it when it is freed between tasks; a split backward gathers in both
# halves, but the input half skips the first unit of stage 0 (whose input needs no gradient).
def _expected(
    schedule: str, checkpoint: str, sync: str, free: bool, m: int, units: int, first: bool
) -> tuple[int, int]:
    recomputed = {"always": m, "never": 0}[checkpoint]
    split = schedule in ("zero_bubble", "zbv")
    if not free:
        gathers = units
    else:
        gathers = ((3 * m if split else 2 * m) + recomputed) * units - (m if split and first else 0)
    return gathers, (m if sync == "per_microbatch" else 1) * units


COUNTED = [
    ("gpipe", "never", "per_microbatch", True),
    ("1f1b", "always", "per_microbatch", True),
    ("zero_bubble", "never", "per_microbatch", True),
    ("zbv", "always", "per_step", True),
    ("1f1b", "never", "per_step", True),
    ("gpipe", "always", "per_step", False),
    ("zero_bubble", "always", "per_step", False),
]


@pytest.mark.parametrize(("schedule", "checkpoint", "sync", "free"), COUNTED)
def test_collectives_per_step_follow_the_formula(
    four: Cluster, schedule: str, checkpoint: str, sync: str, free: bool
) -> None:
    chunks = 3
    results = values(four.run("sharded_cases.collectives", schedule=schedule, chunks=chunks,
                              checkpoint=checkpoint, sync=sync, reshard_after_forward=free,
                              pp=2, dp=2))  # fmt: skip
    for rank, got in enumerate(results):
        expected = _expected(schedule, checkpoint, sync, free, chunks, got["units"],
                             got["first_stage"])  # fmt: skip
        assert (got["all_gather"], got["reduce_scatter"]) == expected, (rank, got)


def _reference_optimized(
    sizes: list[int], max_norm: float
) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """The plain model through the same clipped AdamW steps: the norms, the parameters, the
    loss of the evaluation batch."""
    net = dist_cases.model(4)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    norms = []
    for step, size in enumerate(sizes):
        x, y = dist_cases.batch(size, seed=100 + step)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(net(x), y).backward()
        norms.append(nn.utils.clip_grad_norm_(net.parameters(), max_norm).item())
        opt.step()
    x, y = dist_cases.batch(9, seed=7)
    with torch.no_grad():
        evaluated = nn.functional.mse_loss(net(x), y).item()
    return norms, dict(net.named_parameters()), evaluated


@pytest.mark.parametrize(
    ("schedule", "pp", "scaler"), [("1f1b", 2, False), ("zbv", 2, True), ("gpipe", 1, True)]
)
def test_clip_scaler_optimizer_and_eval_on_shards(
    two: Cluster, four: Cluster, schedule: str, pp: int, scaler: bool
) -> None:
    # The norm covers every shard on every rank; AdamW steps on shards (its state 1/dp per
    # rank) give the plain model's parameters; eval_step leaves every unit sharded.
    sizes, max_norm = [12, 10], 0.05
    cluster = four if pp == 2 else two
    results = values(cluster.run("sharded_cases.optimize", schedule=schedule, pp=pp, dp=2,
                                 sizes=sizes, max_norm=max_norm, scaler=scaler))  # fmt: skip
    norms, params, evaluated = _reference_optimized(sizes, max_norm)
    assert all(n > max_norm for n in norms)  # the clip did something
    for rank, got in enumerate(results):
        assert got["norms"] == pytest.approx(norms, rel=1e-10), rank
        assert got["eval"] == pytest.approx(evaluated, rel=1e-10), rank
        assert got["gathered_after_eval"] == [], rank
        for name, value in got["params"].items():
            got_param = torch.tensor(value, dtype=torch.float64)
            message = f"rank {rank}, {name}"
            torch.testing.assert_close(got_param, params[name], rtol=1e-9, atol=1e-12, msg=message)
        for name, local in got["state"].items():
            assert local <= -(-params[name].numel() // 2) + dist_cases.WIDTH, (name, local)


@pytest.mark.parametrize(("schedule", "sync"), [("1f1b", "per_microbatch"), ("zbv", "per_step")])
def test_gradients_accumulate_across_steps(four: Cluster, schedule: str, sync: str) -> None:
    # No zero_grad between steps: each shard holds the sum of the steps' gradients, as the
    # plain model's .grad does.
    cells = 4 if schedule == "zbv" else 2
    sizes = [12, 9]
    results = _train(four, schedule=schedule, layers=4, balance=[8 // cells] * cells, chunks=3,
                     checkpoint="never", batches=sizes, pp=2, dp=2, sync=sync,
                     zero_grad=False)  # fmt: skip
    _check(results, 4, sizes, dp=2, accumulate=True)


def _uninterrupted() -> dcp_cases.Snapshot:
    net = dist_cases.model(4, seed=0)
    opt = dcp_cases.optimizer(net)
    dcp_cases.train(net, opt, dcp_cases.plain_step, range(dcp_cases.SAVED_AFTER + 1))
    return dcp_cases.snapshot(net, opt)


@pytest.mark.parametrize("flat", [False, True], ids=["default", "flatten"])
def test_a_sharded_checkpoint_resumes_in_every_layout(
    two: Cluster, four: Cluster, tmp_path: Path, flat: bool
) -> None:
    # Saved at pp=2 x sharded dp=2 under the model's own keys; resumed at pp=2 alone,
    # at sharded dp=4, at replicated dp=2 and in the plain model: one more step there equals
    # the run never interrupted (parameters, AdamW moments and step, group settings).
    path = str(tmp_path / "sharded")
    keys = values(four.run("sharded_cases.dcp_saved", path=path, flat=flat, pp=2, shard=True))
    assert set(keys[0]) | set(keys[1]) == set(dist_cases.model(4).state_dict())
    expected = _uninterrupted()
    for cluster, pp, shard in ((two, 2, False), (four, 1, True), (two, 1, False)):
        replies = values(cluster.run("sharded_cases.dcp_resumed", path=path, flat=flat, pp=pp,
                                     shard=shard))  # fmt: skip
        dcp_cases.assert_resumed(replies, expected)
    net = dist_cases.model(4, seed=99)
    opt = dcp_cases.optimizer(net)
    dcp_cases.load(net, opt, path, flat)
    after = dcp_cases.SAVED_AFTER
    dcp_cases.train(net, opt, dcp_cases.plain_step, range(after, after + 1))
    dcp_cases.assert_resumed([dcp_cases.snapshot(net, opt)], expected)


@pytest.mark.parametrize(
    ("model", "schedule", "pp"),
    [("llama", "1f1b", 2), ("llama", "zbv", 2), ("llama", "gpipe", 1), ("gpt2", "1f1b", 2)],
)
def test_any_model_sharded_over_dp(
    two: Cluster, four: Cluster, model: str, schedule: str, pp: int
) -> None:
    # gf.pipeline's stages (LLaMA's decoder layers and glue) sharded at pp=2 x dp=2, and at
    # dp=2 alone (every stage in each process: a stage's shadows of the others are whole);
    # GPT-2's head tied to its embedding across the pipeline ranks.
    stages = 4 if schedule == "zbv" else 2
    cluster = four if pp == 2 else two
    results = values(cluster.run("any_model_cases.across", model=model, schedule=schedule,
                                 stages=stages, pp=pp, shapes=[(8, 8), (12, 6)],
                                 dp_shard=True))  # fmt: skip
    for result in results:
        for step in result["steps"]:
            if step["loss"] is not None:
                assert step["loss"] == pytest.approx(step["plain"], rel=1e-12)
            assert step["grad_error"] < 1e-12
        assert result["param_error"] < 1e-12


def test_replicas_that_would_run_different_tasks_are_refused(two: Cluster) -> None:
    # A sharded stage's replicas must run the same collectives: 2 rows with chunks=3 make
    # two micro-batches, 4 rows three. Every rank raises, before any task runs.
    for kind, message in values(two.run("sharded_cases.uneven_replicas")):
        assert kind == "ValueError"
        assert "different numbers of micro-batches" in message and "chunks=3" in message


def test_bad_sharding_arguments_are_named(two: Cluster) -> None:
    no_group, sync, not_bool, mesh, tied = values(two.run("sharded_cases.bad_arguments"))[0]
    assert no_group.startswith("dp_shard: sharding needs a dp_group")
    assert sync.startswith("dp_shard_sync must be one of 'per_microbatch', 'per_step'")
    assert not_bool == "dp_shard must be a bool, got int"
    assert mesh == "built"
    assert tied.startswith("dp_shard: a weight tied between two cells of one process")
    assert "cell 0's 0.weight = cell 1's 4.weight" in tied


@pytest.mark.parametrize(("schedule", "sync"), [("1f1b", "per_microbatch"), ("zbv", "per_step")])
def test_a_weight_tied_across_ranks_is_sharded(four: Cluster, schedule: str, sync: str) -> None:
    # The Linear at module 0 shares its weight with the one at module 4, on two pipeline
    # ranks: each rank's copy is sharded over its replicas, the copies' gradients are summed
    # shard by shard over the pipeline group.
    cells = 4 if schedule == "zbv" else 2
    ties = ((0, 4),)
    sizes = [12, 9]
    results = _train(four, schedule=schedule, layers=4, balance=[8 // cells] * cells, chunks=3,
                     checkpoint="except_last", batches=sizes, pp=2, dp=2, sync=sync,
                     ties=ties)  # fmt: skip
    _check(results, 4, sizes, dp=2, ties=ties)


def test_float32_stages_reduce_with_a_plain_sum(two: Cluster) -> None:
    # In float32 FSDP would reduce with a pre-multiplied sum, which gloo lacks: the pipe asks
    # for a plain sum (its loss weights already scale each replica's share).
    sizes = [10, 7]
    results = _train(two, schedule="1f1b", layers=4, balance=[4, 4], chunks=2,
                     checkpoint="never", batches=sizes, pp=1, dp=2, dtype="float32")  # fmt: skip
    _check(results, 4, sizes, dp=2, rtol=1e-5)


def test_a_failed_replica_ends_the_others_step_at_once(two: Cluster) -> None:
    # FSDP's collectives are waited for by the pipe's guard: a replica waiting in one for a
    # replica whose step failed raises PeerFailure naming it, long before the timeout.
    timeout = 60.0
    try:
        (kind0, seconds0), (kind1, _) = values(
            two.run("sharded_cases.failing_replica", timeout=timeout)
        )
    finally:
        two.reset()
    assert kind1 == "RuntimeError"
    assert kind0 == "PeerFailure"
    assert seconds0 < timeout / 2


def test_the_runtime_checks_one_task_at_a_time_in_one_order(two: Cluster) -> None:
    for order, overlap in values(two.run("sharded_cases.order_checks")):
        assert "ran its sharded tasks in different orders" in order
        assert "ran two tasks at once (backward 0 while another was running)" in overlap


def test_pipe_after_pipe_reuses_the_cells_groups(two: Cluster) -> None:
    # Each sharded cell has a process group of its own; a process building pipe after pipe
    # (a search over model sizes) reuses them rather than making two more per pipe.
    for counts in values(two.run("sharded_cases.groups_made")):
        assert counts[0] == counts[1] == counts[2]

"""Pipelines across processes (gloo on CPU): every rank's loss and gradients against the whole
model on the whole batch, for every schedule, with data parallelism, on changing shapes; and
one rank's failure or death ending the step on every rank."""

from __future__ import annotations

import copy
from typing import Any

import dist_cases
import gpt
import pytest
import torch
from cluster import Cluster, values
from torch import nn

from gpipe_fast.schedule.registry import builtin_schedules

SCHEDULES = builtin_schedules()


Ties = tuple[tuple[int, int], ...]


def _reference(
    layers: int, size: int, seed: int, ties: Ties = (), clip: Any = None
) -> tuple[float, dict[str, torch.Tensor], float | None]:
    """The whole model on the whole batch: its loss, a tied weight's gradient under each of
    its names (clipped by torch.nn.utils.clip_grad_norm_(*clip) when given) and that norm."""
    net = dist_cases.model(layers, ties=ties)
    x, y = dist_cases.batch(size, seed)
    loss = nn.functional.mse_loss(net(x), y)
    loss.backward()
    norm = None if clip is None else nn.utils.clip_grad_norm_(net.parameters(), *clip).item()
    named = net.named_parameters(remove_duplicate=False)
    return loss.item(), {n: p.grad for n, p in named}, norm  # type: ignore[misc]


def _check_steps(
    results: list[dict[str, Any]],
    layers: int,
    batches: list[int],
    ties: Ties = (),
    clips: list[Any] | None = None,
) -> None:
    """Each rank's loss is the whole batch's; the ranks' gradients together are the whole
    model's, each parameter on exactly one pipeline rank (replicas agree); with `clips`, each
    rank's norm is the whole model's and the gradients are clipped alike."""
    for step, size in enumerate(batches):
        clip = clips[step] if clips else None
        loss, grads, norm = _reference(layers, size, seed=100 + step, ties=ties, clip=clip)
        seen: dict[str, int] = {}
        for rank, result in enumerate(results):
            got = result["steps"][step]
            assert got["loss"] == pytest.approx(loss, rel=1e-12), (rank, step)
            if clip is not None:
                assert norm is not None and norm > clip[0]  # the clip did something
                assert got["norm"] == pytest.approx(norm, rel=1e-10), (rank, step, clip)
            assert got["dtype"] == "torch.float64"
            for name, grad in got["grads"].items():
                torch.testing.assert_close(
                    torch.tensor(grad, dtype=torch.float64), grads[name], rtol=1e-10, atol=1e-12,
                    msg=f"rank {rank}, step {step}, {name}",
                )  # fmt: skip
                seen[name] = seen.get(name, 0) + 1
        assert set(seen) == set(grads), "every parameter's gradient is on some rank"


def _run(cluster: Cluster, **kwargs: Any) -> list[dict[str, Any]]:
    return values(cluster.run("train", **kwargs))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_processes_every_schedule(two: Cluster, schedule: str) -> None:
    cells = 4 if schedule in ("interleaved", "zbv") else 2  # V = 2 cells per process
    batches = [12, 9, 3]  # even, uneven, fewer rows than micro-batches
    results = _run(two, schedule=schedule, layers=4, balance=[8 // cells] * cells, chunks=4,
                   checkpoint="except_last", batches=batches, pp=2, dp=1)  # fmt: skip
    _check_steps(results, 4, batches)
    # Each rank's state dict holds its cells only, under the model's own keys.
    keys = [set(r["keys"]) for r in results]
    assert not keys[0] & keys[1]
    assert keys[0] | keys[1] == set(dist_cases.model(4).state_dict())


def test_shapes_change_between_steps(two: Cluster) -> None:
    # Batch 32, then 48, then 30 with M = 4: a receiver learns each message's shape from its
    # header (torch.distributed.pipelining keeps the first step's buffers).
    batches = [32, 48, 30]
    results = _run(two, schedule="1f1b", layers=4, balance=[4, 4], chunks=4, checkpoint="never",
                   batches=batches, pp=2, dp=1)  # fmt: skip
    _check_steps(results, 4, batches)


def test_data_parallel_replicas_in_one_process_each(two: Cluster) -> None:
    # dp_group alone: each process runs the whole pipeline on its shard; the result is one
    # replica's training on the concatenated batch.
    batches = [10, 7]
    results = _run(two, schedule="zero_bubble", layers=4, balance=[4, 4], chunks=2,
                   checkpoint="always", batches=batches, pp=1, dp=2)  # fmt: skip
    _check_steps(results, 4, batches)
    assert results[0]["steps"][0]["grads"] == results[1]["steps"][0]["grads"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_and_data_parallel_on_four_processes(four: Cluster, schedule: str) -> None:
    cells = 4 if schedule in ("interleaved", "zbv") else 2
    batches = [16, 11]
    results = _run(four, schedule=schedule, layers=4, balance=[8 // cells] * cells, chunks=3,
                   checkpoint="except_last", batches=batches, pp=2, dp=2)  # fmt: skip
    _check_steps(results, 4, batches)


# (processes, pp, dp, schedule, balance, tie): the Linear at module 0 shares its weight with
# the one at module 4. With balance [2, 2, 2, 2] that is cells 0 and 2: one pipeline rank holds
# both under interleaved (a tie within a rank); with [4, 4], cells 0 and 1 on two ranks.
TIE_LAYOUTS = {
    "dp alone, tie within the process": (2, 1, 2, "1f1b", [2, 2, 2, 2]),
    "dp alone, zero bubble": (2, 1, 2, "zero_bubble", [4, 4]),
    "pp alone, tie within a rank": (2, 2, 1, "interleaved", [2, 2, 2, 2]),
    "pp x dp, tie within a rank": (4, 2, 2, "interleaved", [2, 2, 2, 2]),
    "pp x dp, tie across ranks": (4, 2, 2, "1f1b", [4, 4]),
    "pp x dp, zbv, tie across ranks": (4, 2, 2, "zbv", [2, 2, 2, 2]),
}


@pytest.mark.parametrize("layout", list(TIE_LAYOUTS))
def test_a_tied_weight_is_reduced_once_per_group(two: Cluster, four: Cluster, layout: str) -> None:
    # One gradient reduction per tied parameter and group, however many cells, ranks or
    # replicas hold it: each copy ends every step with the whole batch's gradient.
    processes, pp, dp, schedule, balance = TIE_LAYOUTS[layout]
    ties = ((0, 4),)
    batches = [12, 7]
    cluster = two if processes == 2 else four
    results = _run(cluster, schedule=schedule, layers=4, balance=balance, chunks=3,
                   checkpoint="except_last", batches=batches, pp=pp, dp=dp, ties=ties)  # fmt: skip
    _check_steps(results, 4, batches, ties=ties)
    for result in results:  # every rank holding a copy checked it
        names = set(result["steps"][0]["grads"])
        assert names & {"0.weight", "4.weight"} or pp > 1


@pytest.mark.parametrize("layout", list(TIE_LAYOUTS))
def test_clip_grad_norm_is_the_whole_models(two: Cluster, four: Cluster, layout: str) -> None:
    # pipe.clip_grad_norm_ on every rank equals torch's on the whole model (a tied weight
    # once, dp replicas once) for the 2-, 1- and inf-norms, one per step.
    processes, pp, dp, schedule, balance = TIE_LAYOUTS[layout]
    ties, batches = ((0, 4),), [12, 7, 9]
    clips = [(0.05, 2.0), (0.1, 1.0), (0.01, "inf")]
    cluster = two if processes == 2 else four
    results = _run(cluster, schedule=schedule, layers=4, balance=balance, chunks=3,
                   checkpoint="except_last", batches=batches, pp=pp, dp=dp, ties=ties,
                   clips=clips)  # fmt: skip
    _check_steps(results, 4, batches, ties=ties, clips=clips)


@pytest.mark.parametrize(("processes", "pp", "dp", "planted"), [(2, 2, 1, 1), (4, 2, 2, 3)])
def test_grad_scaler_verdict_is_every_ranks(
    two: Cluster, four: Cluster, processes: int, pp: int, dp: int, planted: int
) -> None:
    # An inf on one rank's gradients only: every rank skips that step, and every rank's
    # scale is lowered alike; the clean step before equals plain SGD on the whole batch.
    cluster = two if processes == 2 else four
    results = values(cluster.run("scaled", pp=pp, dp=dp, planted=planted))
    net = dist_cases.model(4)
    plain_opt = torch.optim.SGD(net.parameters(), lr=0.5)
    x, y = dist_cases.batch(8, seed=100)
    nn.functional.mse_loss(net(x), y).backward()
    plain_opt.step()
    for rank, result in enumerate(results):
        assert result["scales"] == [512.0, 256.0], rank  # no growth, then the overflow
        first, second = result["params"]
        assert first == second, f"rank {rank} stepped on the overflowing step"
        for name, value in first.items():
            torch.testing.assert_close(torch.tensor(value, dtype=torch.float64),
                                       net.state_dict()[name], rtol=1e-10, atol=1e-12,
                                       msg=f"rank {rank}, {name}")  # fmt: skip


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_bf16_autocast_reaches_every_rank(two: Cluster, schedule: str) -> None:
    results = values(two.run("autocast_bf16", schedule=schedule))
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    generator = torch.Generator().manual_seed(7)
    x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 8, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(net(x).float(), y)
    loss.backward()
    seen = [dtype for result in results for dtype in result["seen"]]
    assert seen == ["torch.bfloat16"] * 2  # the last cell's two micro-batches, in bf16
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(loss.item(), rel=2e-2), rank
        for name, grad in result["grads"].items():
            torch.testing.assert_close(torch.tensor(grad), net.state_dict(keep_vars=True)[name]
                                       .grad, rtol=5e-2, atol=5e-3, msg=name)  # fmt: skip


def test_threads_split_the_cores_among_the_hosts_processes(two: Cluster) -> None:
    # No setting anywhere: the 2 processes on this host share its (here 8) cores, whatever
    # LOCAL_WORLD_SIZE says (only torchrun sets it; these workers are not torchrun's).
    for reply in values(two.run("thread_rule", cores=8, set_threads=None)):
        assert reply["threads"] == 4
        assert reply["reason"] == (
            "8 cores shared by 2 processes of this job on this host; this process's own "
            "threads too (torch.set_num_threads(4))"
        )
        # The caller's thread (its optimizer step) gets the process's share as well, and a
        # second pipe does not take that share for the user's own setting.
        assert reply["caller"] == 4
        assert reply["again"] == 4


def test_a_users_torch_set_num_threads_is_kept(two: Cluster) -> None:
    for reply in values(two.run("thread_rule", cores=8, set_threads=3)):
        assert reply["threads"] is None  # the worker keeps the user's 3
        assert reply["reason"] == "torch.set_num_threads(3) was called: it is kept"
        assert reply["caller"] == 3 and reply["again"] is None


def test_zbv_puts_the_tied_embedding_and_head_on_one_rank(two: Cluster) -> None:
    # Under zbv rank 0 runs cells 0 and 3, the two ends of the V: the embedding and the head
    # that shares its weight are on one rank, whose copy gets the gradient of both uses.
    reference = dist_cases.tied_model()
    x, y = dist_cases.tokens(12)
    loss = dist_cases.cross_entropy(reference(x), y)
    loss.backward()
    results = values(two.run("tied", schedule="zbv"))
    tied = ("0.weight", "3.weight")
    for result in results:
        assert result["loss"] == pytest.approx(loss.item(), rel=1e-12)
    assert not [n for n in results[1]["grads"] if n in tied], "rank 1 runs cells 1 and 2"
    names = [n for n in results[0]["grads"] if n in tied]
    assert names
    for name in names:
        torch.testing.assert_close(
            torch.tensor(results[0]["grads"][name], dtype=torch.float64), reference[0].weight.grad
        )


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_tied_embedding_and_head_on_two_processes(two: Cluster, schedule: str) -> None:
    reference = dist_cases.tied_model()
    x, y = dist_cases.tokens(12)
    loss = dist_cases.cross_entropy(reference(x), y)
    loss.backward()
    results = values(two.run("tied", schedule=schedule))
    want = reference[0].weight.grad
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(loss.item(), rel=1e-12)
        # Each rank's copy of the shared weight: the sum over both uses.
        names = [n for n in result["grads"] if n in ("0.weight", "3.weight")]
        assert names, f"rank {rank} holds a copy of the tied weight"
        for name in names:
            torch.testing.assert_close(
                torch.tensor(result["grads"][name], dtype=torch.float64), want
            )


def test_a_model_on_the_meta_device_is_built_cell_by_cell(two: Cluster) -> None:
    results = values(two.run("meta"))
    # No rank holds the whole model: the other rank's cells stayed on the meta device.
    assert results[0]["meta"] == ["4.bias", "4.weight", "6.bias", "6.weight"]
    assert results[1]["meta"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # The ranks' state dicts merge into the full model's, which gives the same step.
    merged = {**results[0]["state"], **results[1]["state"]}
    reference = dist_cases.model(4)
    reference.load_state_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in merged.items()})
    x, y = dist_cases.batch(6, seed=7)
    loss = nn.functional.mse_loss(reference(x), y)
    loss.backward()
    for result in results:
        assert result["loss"] == pytest.approx(loss.item(), rel=1e-12)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(
                torch.tensor(grad, dtype=torch.float64),
                dict(reference.named_parameters())[name].grad,
            )


def _gpt_reference(state: dict[str, Any], size: int, replicas: int) -> tuple[float, dict[str, Any]]:
    """The GPT with the pipe's merged weights, trained on the whole batch."""
    reference = gpt.gpt(blocks=2)
    reference.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    x, y = gpt.batch(size, seed=3)
    loss = gpt.loss_fn(reference(x), y)
    loss.backward()
    return loss.item(), dict(reference.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize(("pp", "dp", "schedule"), [(2, 1, "1f1b"), (2, 2, "zero_bubble")])
def test_a_gpt_on_the_meta_device_starts_with_equal_copies(
    two: Cluster, four: Cluster, pp: int, dp: int, schedule: str
) -> None:
    # Every rank is seeded apart: the tie's copies (embedding on the first rank, head on the
    # last) and the data-parallel replicas agree because the pipe makes them.
    results = values((two if pp * dp == 2 else four).run(
        "meta_gpt", pp=pp, dp=dp, balance=[2, 3], schedule=schedule
    ))  # fmt: skip
    states = [r["state"] for r in results]
    for state in states[:pp]:  # the pipeline's ranks first in the (dp, pp) mesh
        assert set(state) & {"0.tokens.weight", "4.weight"}
    first, last = states[0], states[pp - 1]
    assert first["0.tokens.weight"] == last["4.weight"]
    for rank in range(pp, pp * dp):  # each replica equals the first replica's same rank
        assert states[rank] == states[rank % pp]
    merged = {k: v for state in states for k, v in state.items()}
    loss, params = _gpt_reference(merged, 8, dp)
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(loss, rel=1e-6)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(
                torch.tensor(grad), params[name].grad, msg=f"rank {rank}, {name}"
            )


def test_the_whole_models_state_dict_loads_on_every_rank(two: Cluster) -> None:
    whole = gpt.gpt(blocks=2, seed=5).state_dict()
    results = values(two.run("load_whole_model"))
    keys = [set(r["state"]) for r in results]
    assert keys[0] | keys[1] == set(whole) and keys[0] and keys[1]
    for result in results:
        for name, value in result["state"].items():
            assert torch.equal(torch.tensor(value), whole[name]), name
        assert "Unexpected key(s)" in result["errors"]["unknown key"]
        assert '"9.weight"' in result["errors"]["unknown key"]
        assert "Missing key(s)" in result["errors"]["missing key"]
    assert '"1.fc.bias"' in results[0]["errors"]["missing key"]
    assert '"3.bias"' in results[1]["errors"]["missing key"]


def _check_evaluation(results: list[dict[str, Any]], batches: list[int], replicas: int) -> None:
    """Each rank's eval_step loss is the whole batch's (over every replica); pipe(x) under
    no_grad gives its replica's output on the last cell's rank, None elsewhere; no .grad
    was written, a train_step's gradients stay as they were, and the misuses raise."""
    net = dist_cases.model(4)
    for step, size in enumerate(batches):
        x, y = dist_cases.batch(size, seed=100 + step)
        with torch.no_grad():
            loss = nn.functional.mse_loss(net(x), y).item()
        for rank, result in enumerate(results):
            got = result["steps"][step]
            assert got["loss"] == pytest.approx(loss, rel=1e-12), (rank, step)
            assert got["untouched"], f"rank {rank} wrote a .grad in step {step}"
            if not result["last"]:
                assert got["output"] is None, rank
                continue
            with torch.no_grad():
                want = net(dist_cases.shard(x, result["replica"], replicas))
            torch.testing.assert_close(torch.tensor(got["output"], dtype=torch.float64), want,
                                       rtol=1e-12, atol=1e-14)  # fmt: skip
    assert sum(result["last"] for result in results) == replicas  # one output per replica
    for result in results:
        # The forward-only schedule: forwards, losses and activations, no backward or reduction.
        assert set(result["kinds"]) <= {"forward", "loss", "send_forward", "recv_forward"}
        assert ("loss" in result["kinds"]) == result["last"]
        assert result["trained"] and result["after"] == result["trained"]
        (no_grad_kind, no_grad_message), (grad_kind, grad_message) = result["errors"]
        assert no_grad_kind == "RuntimeError" and "pipe.eval_step" in no_grad_message
        assert grad_kind == "RuntimeError"
        assert "pipe.train_step" in grad_message and "pipe.eval_step" in grad_message


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_evaluation_on_two_processes_every_schedule(two: Cluster, schedule: str) -> None:
    cells = 4 if schedule in ("interleaved", "zbv") else 2  # two cells per process
    batches = [12, 9, 3]  # even, uneven, fewer rows than micro-batches
    results = values(two.run("evaluate", schedule=schedule, layers=4, balance=[8 // cells] * cells,
                             chunks=4, batches=batches, pp=2, dp=1))  # fmt: skip
    _check_evaluation(results, batches, replicas=1)


def test_evaluation_of_data_parallel_replicas_in_one_process_each(two: Cluster) -> None:
    # dp_group alone: pipe(x) under no_grad runs each replica's own pipeline on its shard.
    batches = [10, 7]
    results = values(two.run("evaluate", schedule="zero_bubble", layers=4, balance=[4, 4],
                             chunks=2, batches=batches, pp=1, dp=2))  # fmt: skip
    _check_evaluation(results, batches, replicas=2)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_evaluation_with_pipeline_and_data_parallel_on_four_processes(
    four: Cluster, schedule: str
) -> None:
    cells = 4 if schedule in ("interleaved", "zbv") else 2
    batches = [16, 11]
    results = values(four.run("evaluate", schedule=schedule, layers=4, balance=[8 // cells] * cells,
                              chunks=3, batches=batches, pp=2, dp=2))  # fmt: skip
    _check_evaluation(results, batches, replicas=2)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_evaluation_keeps_the_mode_the_user_set(two: Cluster, schedule: str) -> None:
    net = dist_cases.model(4, dropout=0.5).eval()
    x, y = dist_cases.batch(10, seed=9)
    with torch.no_grad():
        plain = nn.functional.mse_loss(net(x), y).item()
    for losses in values(two.run("evaluate_modes", schedule=schedule)):
        assert losses["still training"] == 1.0
        # train(): dropout active, with the very masks train_step draws from the same seed.
        assert losses["eval_step in train()"] == pytest.approx(losses["train_step"], rel=1e-12)
        assert losses["eval_step in train()"] != pytest.approx(plain, rel=1e-3)
        # eval(): dropout off, the plain model's loss.
        assert losses["eval_step in eval()"] == pytest.approx(plain, rel=1e-12)


def test_bad_layouts_are_refused_naming_the_argument(two: Cluster) -> None:
    for errors in values(two.run("bad_layouts")):
        kinds = [kind for kind, _ in errors]
        assert kinds == ["ValueError"] * 5, errors
        messages = [message for _, message in errors]
        assert messages[0].startswith("balance: 3 cells cannot be shared")
        assert messages[1].startswith("balance: 4 cells on 2 processes")
        assert messages[2].startswith("dp_group: it overlaps pp_group")
        assert messages[3].startswith("devices:")
        assert messages[4].startswith("timeout must be > 0")


def test_an_exception_on_one_rank_reaches_every_rank(two: Cluster) -> None:
    replies = two.run("fail", timeout_s=60, failing_rank=1)
    two.reset()  # a failed step leaves the process group to be rebuilt (docs/processes.md)
    failing, other = replies[1], replies[0]
    assert failing.error_type == "KeyError"  # its own type, on the failing rank
    assert "cell 1, micro-batch 2, forward pass" in failing.error
    assert other.error_type == "PeerFailure" and "rank 1" in other.error
    assert "KeyError" in other.error and "planted on rank 1" in other.error
    # Both ended within the pipe's 20 s timeout, not at it: the failure was carried over.
    assert other.seconds < 20


def test_every_rank_names_where_the_failure_started(four: Cluster) -> None:
    # pp=2 x dp=2, rank 3 fails: ranks 0-2 learn it through different paths (its pipeline
    # peer, the data-parallel reduction, a relay), and each names rank 3 and its KeyError,
    # never a rank that failed only because rank 3 did.
    replies = four.run("fail", timeout_s=60, failing_rank=3, pp=2)
    four.reset()
    assert replies[3].error_type == "KeyError"
    for other in replies[:3]:
        assert other.error_type == "PeerFailure", other
        assert other.error.startswith("gpipe_fast: the step failed on rank 3: KeyError"), other
        assert "planted on rank 3" in other.error
        assert "PeerFailure" not in other.error  # not relayed through another rank


@pytest.mark.parametrize(("missing_on", "what"), [(0, "input"), (1, "target")])
def test_a_missing_input_or_target_fails_the_step_on_every_rank(
    two: Cluster, missing_on: int, what: str
) -> None:
    # The rank given None raises its ValueError naming the argument; the other ends its step
    # with that error at once (before, it waited the whole timeout for the batch size).
    replies = values(two.run("missing_input", missing_on=missing_on))
    two.reset()
    bad, other = replies[missing_on]["error"], replies[1 - missing_on]["error"]
    assert bad[0] == "ValueError" and bad[1].startswith(f"{what}: rank {missing_on} runs")
    assert other[0] == "PeerFailure"
    assert other[1].startswith(f"gpipe_fast: the step failed on rank {missing_on}: ValueError")


def test_a_killed_rank_makes_the_others_raise() -> None:
    cluster = Cluster(2)
    try:
        for q in cluster.requests:
            q.put(("fail", {"failing_rank": 1, "kill": True}))
        (survivor,) = cluster.collect_survivors("fail", {0}, timeout_s=90)
        assert survivor.error_type == "PeerFailure", survivor
        assert "rank 1" in survivor.error
        cluster.processes[1].join(timeout=30)
        assert cluster.processes[1].exitcode == 3
    finally:
        cluster.close()


def test_reference_helpers_are_deterministic() -> None:
    # The workers and this process build the same model and batches.
    a, b = dist_cases.model(2), copy.deepcopy(dist_cases.model(2))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert torch.equal(dist_cases.batch(4, 1)[0], dist_cases.batch(4, 1)[0])

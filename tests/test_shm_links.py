"""A pipe's same-host transport: shared-memory rings between the ranks of one host, or gloo."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cluster import Cluster, values
from test_multiprocess import _check_steps

from gpipe_fast import _C
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.distributed.shm_links import (
    CONTROL,
    ENV,
    ShmLinks,
    control_routes,
    lane,
    routes,
)
from gpipe_fast.skip.layout import SkipLayout, SkipRoute
from gpipe_fast.transport import wire
from gpipe_fast.transport.processes.group import GroupMedium
from gpipe_fast.transport.processes.registry import inline_receivers
from gpipe_fast.transport.processes.rings import RingMedium
from gpipe_fast.transport.protocol import ACTIVATION, GRADIENT


def _layout(stage_ranks: tuple[int, ...], ranks: int = 2) -> ProcessLayout:
    return ProcessLayout(None, None, tuple(range(ranks)), 0, len(stage_ranks), stage_ranks)


def test_each_flow_has_its_own_lane() -> None:
    # One receiving thread per lane: activations (and skips), gradients (and theirs).
    assert (lane(ACTIVATION), lane(GRADIENT)) == (0, 1)


def test_a_message_lays_out_its_tensors_as_an_inline_one() -> None:
    assert wire.ALIGN == _C.SHM_PART_ALIGN
    assert wire.HEADER_LENGTH * 8 % _C.SHM_PART_ALIGN == 0


def test_rings_follow_the_boundaries_between_ranks() -> None:
    # 1f1b on 2 ranks: one boundary, activations 0 -> 1 and gradients 1 -> 0.
    assert routes(_layout((0, 1)), None) == {(0, 1, 0), (1, 0, 1)}
    # Interleaved on 2 ranks: boundaries both ways, each flow on its own lane.
    assert routes(_layout((0, 1, 0, 1)), None) == {(0, 1, 0), (1, 0, 0), (0, 1, 1), (1, 0, 1)}
    # zbv on 2 ranks: cells 1 and 2 on one rank need no ring between them.
    assert routes(_layout((0, 1, 1, 0)), None) == {(0, 1, 0), (1, 0, 0), (0, 1, 1), (1, 0, 1)}
    # 3 ranks in a chain: no ring between ranks 0 and 2...
    chain = _layout((0, 1, 2), ranks=3)
    assert {(s, r) for s, r, _ in routes(chain, None)} == {(0, 1), (1, 0), (1, 2), (2, 1)}
    # ... unless a skip goes from cell 0 to cell 2, past rank 1.
    skips = SkipLayout(3, [SkipRoute(None, "far", 0, 2), SkipRoute(None, "inside", 1, 1)])
    skipped = routes(chain, skips)
    assert {(0, 2, 0), (2, 0, 1)} <= skipped
    assert len(skipped) == 6


def _inline(layout: ProcessLayout, every: set[tuple[int, int, int]],
            rings: set[tuple[int, int, int]]) -> list[int]:  # fmt: skip
    """The positions receiving inline when `rings` are shared memory, the rest the group's."""
    links = ShmLinks({}, {}, rings)
    media = [RingMedium(links, None), GroupMedium(layout, None, torch.device("cpu"))]  # type: ignore[arg-type]
    return inline_receivers(layout.pp_size, every, media)


def test_ranks_that_receive_only_over_shared_memory_receive_inline() -> None:
    layout = _layout((0, 1, 2), ranks=3)
    chain = routes(layout, None)
    assert _inline(layout, chain, chain) == [0, 1, 2]
    # Rank 2 on another host: rank 1 receives its gradients over gloo, so it keeps its
    # receiving workers; rank 0 hears only from rank 1, over shared memory.
    rings = {(s, r, n) for s, r, n in chain if 2 not in (s, r)}
    assert _inline(layout, chain, rings) == [0]
    assert _inline(layout, chain, set()) == []


def test_the_steps_agreed_values_go_from_the_first_and_last_cells_ranks_to_the_others() -> None:
    assert control_routes(_layout((0, 1))) == {(0, 1, CONTROL), (1, 0, CONTROL)}
    # zbv on 2 ranks: cells 0 and 3 (the batch's and the loss's) both on rank 0.
    assert control_routes(_layout((0, 1, 1, 0))) == {(0, 1, CONTROL)}
    chain = control_routes(_layout((0, 1, 2), ranks=3))
    assert chain == {(0, 1, CONTROL), (0, 2, CONTROL), (2, 0, CONTROL), (2, 1, CONTROL)}


def test_over_shared_memory_a_step_needs_no_broadcast_of_the_group(two: Cluster) -> None:
    # The batch size and the loss go through the rings' control lane: with the group's
    # broadcast refused, the steps still equal the whole model's; over gloo they need it.
    kwargs = dict(inner="train", schedule="zbv", layers=4, balance=[2, 2, 2, 2], chunks=4,
                  checkpoint="never", batches=[12, 5], pp=2, dp=1)  # fmt: skip
    shm = values(two.run("without_broadcast", **kwargs))
    _check_steps(shm, 4, [12, 5])
    replies = two.run("with_env", env={ENV: "gloo"}, case="without_broadcast", **kwargs)
    two.reset()  # a failed step leaves the process group to be rebuilt (docs/processes.md)
    assert all("torch.distributed.broadcast was called" in (r.error or "") for r in replies)


def _train(cluster: Cluster, env: dict[str, str], schedule: str = "1f1b") -> list[dict[str, Any]]:
    balance = [2, 2, 2, 2] if schedule in ("interleaved", "zbv") else [4, 4]
    return values(cluster.run(
        "with_env", env=env, case="train", schedule=schedule, layers=4, balance=balance,
        chunks=4, checkpoint="except_last", batches=[12, 5], pp=2, dp=1,
    ))  # fmt: skip


def test_same_host_ranks_use_shared_memory_and_gloo_when_asked(two: Cluster) -> None:
    shm = _train(two, {})
    gloo = _train(two, {ENV: "gloo"})
    assert [r["transport"] for r in shm] == ["shared memory"] * 2, shm[0]["transport_reason"]
    assert [r["transport"] for r in gloo] == ["gloo"] * 2
    assert gloo[0]["transport_reason"] == f"{ENV}=gloo on this rank"
    # Both equal the whole model on the whole batch, and each other exactly.
    _check_steps(shm, 4, [12, 5])
    _check_steps(gloo, 4, [12, 5])
    assert [r["steps"] for r in shm] == [r["steps"] for r in gloo]


@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble", "interleaved", "zbv"])
def test_every_schedule_is_exact_with_inline_receives_and_receiving_workers(
    two: Cluster, schedule: str
) -> None:
    # Over shared memory the compute workers receive their messages themselves; over gloo
    # the receiving workers do: the same steps either way, equal to the whole model.
    shm = _train(two, {}, schedule)
    gloo = _train(two, {ENV: "gloo"}, schedule)
    assert [r["transport"] for r in shm + gloo] == ["shared memory"] * 2 + ["gloo"] * 2
    _check_steps(shm, 4, [12, 5])
    _check_steps(gloo, 4, [12, 5])
    assert [r["steps"] for r in shm] == [r["steps"] for r in gloo]


def test_gloo_on_one_rank_is_gloo_for_the_whole_pipe(two: Cluster) -> None:
    results = values(two.run(
        "with_env", env={ENV: "gloo"}, only=[1], case="train", schedule="1f1b", layers=2,
        balance=[2, 2], chunks=2, checkpoint="never", batches=[4], pp=2, dp=1,
    ))  # fmt: skip
    assert [r["transport"] for r in results] == ["gloo", "gloo"]
    assert results[0]["transport_reason"] == f"{ENV}=gloo on another rank of the pipe"
    assert results[1]["transport_reason"] == f"{ENV}=gloo on this rank"


def test_an_unknown_transport_is_refused(two: Cluster) -> None:
    replies = two.run("with_env", env={ENV: "carrier-pigeon"}, case="train", schedule="1f1b",
                      layers=2, balance=[2, 2], chunks=2, checkpoint="never", batches=[4],
                      pp=2, dp=1)  # fmt: skip
    for reply in replies:
        assert reply.error_type == "ValueError" and "carrier-pigeon" in reply.error, reply
    # Set on one rank only: every rank refuses it at once (none waits for the others).
    replies = two.run("with_env", env={ENV: "carrier-pigeon"}, only=[1], case="train",
                      schedule="1f1b", layers=2, balance=[2, 2], chunks=2, checkpoint="never",
                      batches=[4], pp=2, dp=1)  # fmt: skip
    assert replies[1].error_type == "ValueError" and "carrier-pigeon" in replies[1].error
    assert replies[0].error_type == "ValueError", replies[0]
    assert f"{ENV} on another rank of the pipe" in replies[0].error  # not a timeout's error


def test_a_failure_over_shared_memory_reaches_every_rank_and_leaves_nothing(
    two: Cluster,
) -> None:
    replies = values(two.run("shm_failure", failing_rank=1))
    two.reset()  # a failed step leaves the process group to be rebuilt (docs/processes.md)
    failing, other = replies[1], replies[0]
    assert failing["transport"] == other["transport"] == "shared memory"
    assert failing["error"][0] == "KeyError"
    assert other["error"][0] == "PeerFailure", other["error"]
    assert other["error"][1].startswith("gpipe_fast: the step failed on rank 1: KeyError")
    for result in replies:
        assert result["refused"][0] == "PeerFailure" and "earlier step" in result["refused"][1]
        # One ring each way for the tensors (activations, gradients) and one each way for
        # the step's agreed values (the batch size from rank 0, the loss from rank 1).
        assert len(result["names"]) == 4
        assert sum(name.endswith("-l2") for name in result["names"]) == 2
        assert result["open_left"] == result["left"] == []  # unlinked once both attached
    # A pipe built after the group was rebuilt gets rings of its own.
    again = values(two.run("shm_failure", failing_rank=-1))
    assert [r["error"] for r in again] == [("none", "")] * 2
    assert not set(again[0]["names"]) & set(replies[0]["names"])
    assert again[0]["left"] == again[1]["left"] == []

"""dp_shard's collectives waited for by the pipe's guard: in pp 2 x dp 2 with sharded stages,
a rank that raises, dies or is slow in the middle of a step is named by every other rank as
with replicated stages, no rank of another pipeline is blamed, no gloo wording reaches the
user, and every step ends at once rather than at the timeout. Every victim, both policies,
the ranks in the pool or, to die, in a job of their own (no torchrun)."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster, values
from jobs import run_job

JOB = str(Path(__file__).with_name("sharded_comms_job.py"))
SYNCS = ("per_microbatch", "per_step")
VICTIMS = (0, 1, 2, 3)
# The pipes' timeout (sharded_comms_cases) is 120 s: a step that ends within this did not wait
# for it (before the collectives were guarded, a replica of the failing rank waited it out).
PROMPT_S = 60.0
# gloo's own wording of a broken connection (its source line, the peer's address, its advice).
GLOO_TEXT = ("pair.cc", "This is typically caused", "[127.0.0.1]")


def _assert_named(results: list[dict[str, Any]], victim: int, cause: str) -> None:
    """Every rank but the victim raised PeerFailure naming it with `cause`, at once."""
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        message = result["message"]
        assert result["type"] == "PeerFailure", (rank, result)
        assert f"the step failed on rank {victim}: {cause}" in message, (rank, message)
        for alive in set(range(len(results))) - {victim}:
            assert f"failed on rank {alive}" not in message, (rank, message)
        assert not any(text in message for text in GLOO_TEXT), (rank, message)
        assert result["seconds"] < PROMPT_S, (rank, result)


def _raised(four: Cluster, **kwargs: Any) -> list[dict[str, Any]]:
    try:
        return values(four.run("sharded_comms_cases.sharded_fault", **kwargs))
    finally:
        four.reset()  # a failed step leaves the process group to be rebuilt


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("victim", VICTIMS)
def test_a_rank_that_raises_is_named_by_every_other(four: Cluster, victim: int, sync: str) -> None:
    results = _raised(four, mode="raise", victim=victim, sync=sync)
    assert results[victim]["type"] == "Planted"
    assert results[victim]["message"].endswith(f"forward pass: planted on rank {victim}")
    _assert_named(results, victim, "Planted: gpipe_fast: in cell ")


def _job_results(victim: int, sync: str) -> tuple[int, list[dict[str, Any]]]:
    """The victim's pid and every rank's result (None for the victim) of a job where
    `victim` is SIGKILLed in the middle of a step."""
    ended = run_job(JOB, 4, "kill", str(victim), sync)
    assert ended[victim].code == -signal.SIGKILL, ended[victim]
    results: list[dict[str, Any]] = []
    for rank, rank_ended in enumerate(ended):
        found = re.search(rf"^rank {rank} result (.*)$", rank_ended.stderr, re.MULTILINE)
        if rank != victim:
            assert found, f"rank {rank} printed no result:\n{rank_ended.stderr[-3000:]}"
            assert rank_ended.code == 0, rank_ended
        results.append(json.loads(found.group(1)) if found else {})
    return ended[victim].pid, results


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("victim", VICTIMS)
def test_a_rank_that_dies_is_named_by_every_other(victim: int, sync: str) -> None:
    # Its replica sees the death in an FSDP collective; the others hear of it second-hand.
    pid, results = _job_results(victim, sync)
    _assert_named(results, victim, f"died (process {pid} ended)")


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "replicated"])
def test_a_slow_rank_is_named_as_slow_by_every_rank_itself_included(
    four: Cluster, shard: bool
) -> None:
    # Rank 2 (stage 0 of the second pipeline) is inside a forward for 7 s; the pipes wait 4 s.
    results = _raised(four, mode="slow", victim=2, shard=shard, timeout=4.0, slow_s=7.0)
    said = "the step failed on rank 2: rank 2 did not answer within 4 s (its process still runs"
    for rank, result in enumerate(results):
        assert result["type"] == "PeerFailure", (rank, result)
        assert said in result["message"], (rank, result["message"])
        assert "died" not in result["message"], (rank, result["message"])
        # The slow rank's own error names itself, not a rank that waited for it.
        assert "failed on rank 0" not in result["message"], (rank, result["message"])

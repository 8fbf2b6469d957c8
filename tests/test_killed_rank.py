"""A SIGKILLed rank is named by every survivor, which then exits: whichever rank hosted the
store, and with pp x dp a dead rank of the other pipeline is not blamed on a live one."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from jobs import run_job

CASE = str(Path(__file__).with_name("kill_case.py"))


def _run_job(world: int, killed: int, pp: int, *extra: str) -> dict[int, tuple[int, int, str]]:
    """Every rank of the job (started by hand, rank 0 hosting the TCP store): rank -> (pid,
    exit code, stderr). A survivor that waited for the dead rank at exit would wait forever
    (kill_case.py unbounds the linger) and fail the test as a hang."""
    ended = run_job(CASE, world, str(killed), str(pp), *extra)
    return {rank: (e.pid, e.code, e.stderr) for rank, e in enumerate(ended)}


def _caught(rank: int, err: str) -> str:
    found = re.search(rf"^rank {rank} caught (.*)$", err, re.MULTILINE)
    assert found, f"rank {rank} did not raise:\n{err[-3000:]}"
    return found.group(1)


def _assert_survivors_name(results: dict[int, tuple[int, int, str]], killed: int) -> None:
    pid, code, _ = results[killed]
    assert code == -signal.SIGKILL, f"rank {killed} was to be killed: exit code {code}"
    for rank, (_, code, err) in results.items():
        if rank == killed:
            continue
        caught = _caught(rank, err)
        assert caught.startswith("PeerFailure: "), f"rank {rank}: {caught}"
        named = f"the step failed on rank {killed}: died (process {pid} ended)"
        assert named in caught, f"rank {rank}: {caught}"
        for alive in set(results) - {killed, rank}:  # no live rank is said to have failed
            assert f"failed on rank {alive}" not in caught, f"rank {rank}: {caught}"
        assert code == 1, f"rank {rank}: exit code {code}\n{err[-3000:]}"


@pytest.mark.parametrize("killed", [0, 1], ids=["the-store-host", "the-last-rank"])
def test_a_killed_rank_of_two_is_named_and_the_survivor_exits(killed: int) -> None:
    _assert_survivors_name(_run_job(2, killed, pp=2), killed)


def test_a_killed_rank_of_another_pipeline_is_not_blamed_on_a_live_rank() -> None:
    # pp 2 x dp 2: pipelines (0, 1) and (2, 3), replicas (0, 2) and (1, 3). Rank 1 sees rank
    # 3 die in their data-parallel sum; ranks 0 and 2 must name rank 3, not rank 1.
    _assert_survivors_name(_run_job(4, 3, pp=2), 3)


def test_a_rank_killed_during_a_dcp_save_is_named(tmp_path: Path) -> None:
    _assert_survivors_name(_run_job(2, 1, 2, "dcp", str(tmp_path / "checkpoint")), 1)

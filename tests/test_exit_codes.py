"""Processes end with their own exit code after a failed step: no abort, the failure named."""

from __future__ import annotations

from pathlib import Path

from jobs import run_job

CASE = str(Path(__file__).with_name("exit_case.py"))
EXPECTED = {"raise": 1, "destroy": 1, "exit3": 3}


def _run_job(failing: int, ending: str) -> list[tuple[int, str]]:
    """Both ranks of a job over gloo, rank 0 hosting the TCP store: (exit code, stderr)."""
    ended = run_job(CASE, 2, str(failing), ending, timeout_s=90)
    return [(rank.code, rank.stderr) for rank in ended]


# 24 failed steps (3 in the fast suite): the failing rank is the store's host or not, and each
# way of ending.
JOBS = [(failing, ending) for failing in (0, 1) for ending in EXPECTED] * 4
FAST_JOBS = [(i % 2, ending) for i, ending in enumerate(EXPECTED)]


def test_failed_steps_end_with_the_processes_own_exit_codes(full: bool) -> None:
    aborted = []
    # The fast suite ends a job each way once, the failing rank the store's host or not in
    # turn (all 24 took 4 minutes on a loaded 2-core machine); the full suite runs all, since
    # an abort at exit may come by chance.
    for failing, ending in JOBS if full else FAST_JOBS:
        results = _run_job(failing, ending)
        for rank, (code, err) in enumerate(results):
            where = f"rank {rank} of job (failing={failing}, {ending})"
            if code != EXPECTED[ending]:
                aborted.append(f"{where}: exit code {code}\n{err[-2000:]}")
            assert "terminate called" not in err, where
            assert "Exception raised from" not in err, f"{where} printed a C++ trace:\n{err}"
            if rank == failing:
                assert f"caught ValueError: gpipe_fast: in cell {failing}" in err, where
            else:  # the failure's rank and error, even when that rank hosts the store
                assert f"caught PeerFailure: gpipe_fast: the step failed on rank {failing}: " \
                    f"ValueError" in err, f"{where}:\n{err[-2000:]}"  # fmt: skip
    assert not aborted, "\n\n".join(aborted)


def test_a_successful_step_exits_zero() -> None:
    for rank, (code, err) in enumerate(_run_job(-1, "raise")):
        assert code == 0, f"rank {rank}: {code}\n{err[-2000:]}"

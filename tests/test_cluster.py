"""The test workers (tests/cluster.py): a death is named with its cause, and the next case
runs on fresh workers rather than failing on the dead one."""

from __future__ import annotations

import pytest
from cluster import Cluster, values


def test_a_worker_killed_by_a_signal_is_named_with_its_traceback(two: Cluster) -> None:
    before = values(two.run("cluster_cases.rank_and_pid"))
    with pytest.raises(AssertionError) as failed:
        two.run("cluster_cases.dies", dying_rank=1, how="segfault")
    message = str(failed.value)
    assert "cluster_cases.dies: worker(s) [1] died without replying" in message
    assert "rank 1: killed by SIGSEGV" in message
    assert "Fatal Python error: Segmentation fault" in message  # its log: faulthandler's
    assert "cluster_cases.py" in message  # the dying thread's stack, down to the case
    # The next case gets a fresh pair (both replaced: their process group was the dead one's).
    after = values(two.run("cluster_cases.rank_and_pid"))
    assert [rank for rank, _ in after] == [0, 1]
    assert not {pid for _, pid in before} & {pid for _, pid in after}


def test_a_worker_that_exits_is_named_with_its_exit_code_and_last_words(two: Cluster) -> None:
    with pytest.raises(AssertionError) as failed:
        two.run("cluster_cases.dies", dying_rank=0, how="exit")
    message = str(failed.value)
    assert "rank 0: exit code 7" in message
    assert "rank 0 says goodbye on stderr" in message
    assert values(two.run("cluster_cases.dies", dying_rank=-1, how="exit")) == [0, 1]

"""The shared-memory channel (_C.ShmSender / ShmReceiver) between two real processes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import shm_cases
from cluster import Cluster, values

RING_BYTES = 1 << 16  # small, so that the tests' larger messages stream through it


def _connect(cluster: Cluster, ring_bytes: int) -> str:
    """Links the cluster's two workers under a fresh prefix (unique per run); checks that
    nothing of it is left in /dev/shm once both have attached."""
    prefix = f"/gpf-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    left = values(cluster.run("shm_cases.shm_connect", prefix=prefix, ring_bytes=ring_bytes))
    assert left == [[], []]
    return prefix


@pytest.fixture(scope="module")
def linked(two: Cluster) -> Iterator[tuple[Cluster, str]]:
    """The module's two workers with a ring per direction and lane between them."""
    prefix = _connect(two, RING_BYTES)
    yield two, prefix
    assert values(two.run("shm_cases.shm_disconnect", prefix=prefix)) == [[], []]
    assert shm_cases.leftovers(prefix) == []


def test_tensors_of_every_size_and_dtype_make_the_round_trip(linked: tuple[Cluster, str]) -> None:
    cluster, prefix = linked
    sent, echoed = values(cluster.run("shm_cases.shm_round_trip", prefix=prefix))
    assert sent == echoed == [True] * len(shm_cases.MESSAGES)
    assert shm_cases.leftovers(prefix) == []  # unlinked at connection


def test_messages_are_received_by_tag_in_any_order(linked: tuple[Cluster, str]) -> None:
    cluster, prefix = linked
    _, aside = values(cluster.run("shm_cases.shm_out_of_order", prefix=prefix))
    # Asking for 107 first keeps the seven before it aside, then each receive takes one out.
    assert aside == [7, 6, 5, 4, 3, 2, 1, 0]


def test_a_full_ring_does_not_block_the_sender(linked: tuple[Cluster, str]) -> None:
    cluster, prefix = linked
    sender, _ = values(cluster.run("shm_cases.shm_full_ring", prefix=prefix, ring_bytes=RING_BYTES))
    assert sender["seconds"] < 2.0, sender  # 16 rings' worth, nobody reading
    assert 1 <= sender["direct"] < 32
    assert sender["queued"] > 8 * RING_BYTES
    assert sender["after_flush"] == 0


def test_several_sending_threads_and_one_receiving_thread_per_lane(
    linked: tuple[Cluster, str],
) -> None:
    cluster, prefix = linked
    assert values(cluster.run("shm_cases.shm_threads_and_lanes", prefix=prefix)) == [0, 600]


def test_a_receive_that_gets_nothing_raises_timeout_error(linked: tuple[Cluster, str]) -> None:
    cluster, prefix = linked
    _, waited = values(cluster.run("shm_cases.shm_timeout", prefix=prefix, wait_s=0.2))
    assert waited["error"] is not None and "no message tagged 999" in waited["error"]
    assert 0.2 <= waited["seconds"] < 1.0


def test_closing_either_side_ends_the_peers_wait_at_once() -> None:
    # Its own pair of workers: the channels are unusable afterwards.
    cluster = Cluster(2)
    try:
        prefix = _connect(cluster, 4096)
        closer, waiter = values(cluster.run("shm_cases.shm_close", prefix=prefix))
        assert waiter["error"] is not None, waiter
        assert "closed by the sender after a failure: rank 0 failed" in waiter["error"]
        assert waiter["seconds"] < 2.0  # the close came after 0.2 s; the wait was 30 s
        assert closer["error"] is not None and "rank 1 failed" in closer["error"]
    finally:
        cluster.close()
    assert shm_cases.leftovers(prefix) == []


def test_a_peer_that_dies_makes_the_wait_raise_and_leaves_nothing() -> None:
    cluster = Cluster(2)
    try:
        prefix = _connect(cluster, 4096)
        for q in cluster.requests:
            q.put(("shm_cases.shm_die", {"prefix": prefix}))
        (survivor,) = cluster.collect_survivors("shm_die", {0}, timeout_s=60)
        assert not survivor.failed, survivor
        assert survivor.value["error"] is not None and "exited" in survivor.value["error"]
        assert survivor.value["seconds"] < 2.0  # rank 1 died after 0.3 s; the wait was 60 s
        cluster.processes[1].join(timeout=30)
        assert cluster.processes[1].exitcode == 3
    finally:
        cluster.close()
    assert shm_cases.leftovers(prefix) == []

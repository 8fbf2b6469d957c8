"""A pipe across processes gives its threads back when closed: a process that builds pipe
after pipe (a search over model sizes, say) keeps the same threads and address space."""

from __future__ import annotations

from cluster import Cluster


def test_closing_pipes_ends_their_helper_threads(two: Cluster) -> None:
    # Each pipe's guard started 4 threads for its waits that no close ended: 8 MiB of stack
    # address space each, per pipe built.
    replies = two.run("close_cases.threads_after_close", pipes=3)
    assert all(not reply.failed for reply in replies), replies
    for reply in replies:
        assert reply.value["after"] == reply.value["before"]

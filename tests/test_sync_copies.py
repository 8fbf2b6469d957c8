"""Every copy of a weight starts equal across processes: replicas take the first rank's
parameters and buffers, a tie's copies those of the rank holding its first cell."""

from __future__ import annotations

from cluster import Cluster, values


def test_replicas_take_the_first_ranks_values(two: Cluster) -> None:
    first, second = values(two.run("grad_sync_cases.replicas"))
    assert first["before"] != second["before"]  # every tensor started apart
    assert all(first["before"][k] != second["before"][k] for k in first["before"])
    assert first["after"] == first["before"]
    assert second["after"] == first["before"]


def test_each_ties_copies_take_its_first_cells_values(two: Cluster) -> None:
    first, second = values(two.run("grad_sync_cases.ties"))
    assert first["names"] == second["names"] == ["0.weight", "0.bias", "1.weight"]
    # 0.weight: cells 0 (rank 0) and 3 (rank 1); 0.bias: cells 0 and 2, both on rank 0;
    # 1.weight: cells 1 (rank 1) and 2 (rank 0).
    weight, bias, other = range(3)
    assert first["before"][weight] != second["before"][weight]
    assert first["after"][weight] == second["after"][weight] == first["before"][weight]
    assert first["after"][bias] == first["before"][bias] and second["after"][bias] is None
    assert first["before"][other] != second["before"][other]
    assert first["after"][other] == second["after"][other] == second["before"][other]

"""Every transport against the Transport protocol: one scenario calling each of its methods,
over the in-process transport and across two processes over each medium."""

from __future__ import annotations

import pytest
import transport_conformance_cases as cases
from cluster import Cluster, values


def test_the_protocol_is_read_from_its_class() -> None:
    assert {"send", "recv", "post", "fetch", "discard", "pending"} <= set(cases.PROTOCOL)


def test_the_in_process_transport_conforms() -> None:
    assert cases.in_process() == cases.PROTOCOL


@pytest.mark.parametrize("medium", list(cases.MEDIA))
def test_the_transport_across_processes_conforms_over_each_medium(
    two: Cluster, medium: str
) -> None:
    results = values(two.run("transport_conformance_cases.over_medium", medium=medium))
    assert [r["kind"] for r in results] == [medium] * 2
    # Each rank calls what its cell's half of the scenario needs: together, every method.
    assert sorted(set(results[0]["called"]) | set(results[1]["called"])) == cases.PROTOCOL

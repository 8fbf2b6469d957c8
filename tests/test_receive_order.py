"""Receives across processes, in the order of a recorded step's events: each value is in
before the task that reads it starts, and each receiving worker takes its messages one at a
time in its schedule's order (no wall-clock threshold: only the order of starts and ends)."""

from __future__ import annotations

import itertools

import pytest
from cluster import Cluster, values

# The compute actions that read what each receive task brings in.
READS = {
    "recv_forward": ("forward",),
    "recv_skips": ("forward",),
    "recv_backward": ("backward", "backward_input"),
    "recv_skip_grads": ("backward", "backward_input"),
}


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero_bubble", "zbv"])
def test_every_receive_ends_before_its_reader_starts_and_keeps_its_order(
    two: Cluster, schedule: str
) -> None:
    kinds: set[str] = set()
    for rank, result in enumerate(values(two.run("recorded_step", schedule=schedule))):
        spans = {(kind, cell, m): (start, end, worker)
                 for kind, cell, m, start, end, worker in result["spans"]}  # fmt: skip
        receives = [key for key in spans if key[0] in READS]
        kinds |= {key[0] for key in receives}
        for kind, cell, m in receives:
            received = spans[(kind, cell, m)][1]
            readers = [spans[(r, cell, m)] for r in READS[kind] if (r, cell, m) in spans]
            assert readers, (rank, kind, cell, m)
            assert received <= readers[0][0], (rank, kind, cell, m)
        # Each receiving worker ran its receives one at a time, in its schedule's order.
        for order in result["orders"]:
            listed = [tuple(key) for key in order if key[0] in READS]
            if not listed:
                continue
            ran = sorted(listed, key=lambda key: spans[key][0])
            assert ran == listed, (rank, schedule)
            for before, after in itertools.pairwise(ran):
                assert spans[before][1] <= spans[after][0], (rank, before, after)
    assert kinds == set(READS)  # the step received activations, skips and both gradients

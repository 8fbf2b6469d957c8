"""Ctrl-C across processes: SIGINT to a rank ends its step, and the other rank learns of it
within a poll, even while either waits on the other or in a collective; the interrupted
rank's own forward, when it is inside one, finishes first."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster import Cluster, values

# Far longer than any reaction: the pipes' timeout is 120 s and rank 0's slow forward lasts
# until a rank's step has raised (a minute at most), so a step that ends within this has not
# waited for either.
PROMPT_S = 30.0


def _run(two: Cluster, tmp_path: Path, target: int, shard: bool) -> list[dict]:
    try:
        return values(two.run("ctrl_c_cases.interrupted", target=target, folder=str(tmp_path),
                              shard=shard))  # fmt: skip
    finally:
        two.reset()  # a failed step leaves the process group to be rebuilt


@pytest.mark.parametrize("shard", [False, True], ids=["waiting-for-a-peer", "in-a-collective"])
def test_the_interrupted_rank_stops_waiting_and_its_peer_is_told(
    two: Cluster, tmp_path: Path, shard: bool
) -> None:
    # Rank 1 waits for rank 0 (its activation; with dp_shard, an all-gather) when Ctrl-C
    # comes: its step ends at once, while rank 0's forward is still running.
    interrupted, peer = _run(two, tmp_path, target=1, shard=shard)[::-1]
    assert interrupted["type"] == "KeyboardInterrupt"
    assert interrupted["after_sigint"] < PROMPT_S
    assert peer["type"] == "PeerFailure"
    assert "the step failed on rank 1: KeyboardInterrupt: interrupted (Ctrl-C)" in peer["message"]


@pytest.mark.parametrize("shard", [False, True], ids=["waiting-for-a-peer", "in-a-collective"])
def test_a_peer_learns_of_ctrl_c_inside_a_long_forward_at_once(
    two: Cluster, tmp_path: Path, shard: bool
) -> None:
    # Ctrl-C to rank 0 inside its slow forward: rank 1, waiting for it, raises at once; rank
    # 0's KeyboardInterrupt comes when its forward ends (released by rank 1's raising).
    interrupted, peer = _run(two, tmp_path, target=0, shard=shard)
    assert peer["type"] == "PeerFailure"
    assert "the step failed on rank 0: KeyboardInterrupt: interrupted (Ctrl-C)" in peer["message"]
    assert peer["after_sigint"] < PROMPT_S
    assert interrupted["type"] == "KeyboardInterrupt"

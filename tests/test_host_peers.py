"""Which ranks share a host: counted for the threads, paired for the shared-memory rings."""

from __future__ import annotations

from gpipe_fast.distributed.host_peers import HostPeers


def test_ranks_on_one_host_are_counted_and_paired() -> None:
    # Ranks 0, 1 and 3 on one host, rank 2 on another.
    peers = HostPeers(hosts=(7, 7, 9, 7), rank=1)
    assert peers.processes_here == 3
    assert peers.same_host(0, 3) and peers.same_host(1, 1)
    assert not peers.same_host(1, 2)
    assert HostPeers(hosts=(7, 7, 9, 7), rank=2).processes_here == 1

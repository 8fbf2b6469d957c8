"""Which processes of the job share this host: the ranks tell each other their host name."""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class HostPeers:
    """The host of every rank of the default process group (a hash of its name), as this
    rank (`rank`) learnt them."""

    hosts: tuple[int, ...]
    rank: int

    @property
    def processes_here(self) -> int:
        """The ranks on this rank's host, this one included."""
        return self.hosts.count(self.hosts[self.rank])

    def same_host(self, a: int, b: int) -> bool:
        """Whether global ranks `a` and `b` run on one host."""
        return self.hosts[a] == self.hosts[b]


def host_peers() -> HostPeers:
    """Every rank's host: one all-gather of a number per rank, so every rank must call it (as
    every rank builds its pipe). LOCAL_WORLD_SIZE is not trusted: only torchrun sets it."""
    digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest()
    mine = int.from_bytes(digest, "big")
    hosts = [torch.empty(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(hosts, torch.tensor([mine], dtype=torch.int64))
    return HostPeers(tuple(int(h.item()) for h in hosts), dist.get_rank())

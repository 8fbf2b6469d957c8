"""Which processes of the job share this host: the ranks tell each other their host and pid."""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpipe_fast.distributed.liveness import Processes, ProcessId, this_process


@dataclass(frozen=True)
class HostPeers:
    """The host of every rank of the default process group (a hash of its name), as this
    rank (`rank`) learnt them, and every rank's process (empty where not learnt)."""

    hosts: tuple[int, ...]
    rank: int
    processes: tuple[ProcessId, ...] = ()

    @property
    def processes_here(self) -> int:
        """The ranks on this rank's host, this one included."""
        return self.hosts.count(self.hosts[self.rank])

    def same_host(self, a: int, b: int) -> bool:
        """Whether global ranks `a` and `b` run on one host."""
        return self.hosts[a] == self.hosts[b]

    def liveness(self) -> Processes | None:
        """Every rank's process, to probe whether it ended (None when not learnt)."""
        return Processes(self.processes, self.rank) if self.processes else None


def host_peers() -> HostPeers:
    """Every rank's host and process: one all-gather of four numbers per rank, so every rank
    must call it (as every rank builds its pipe). LOCAL_WORLD_SIZE is not trusted: only
    torchrun sets it."""
    digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest()
    me = this_process()
    mine = torch.tensor([int.from_bytes(digest, "big"), me.pid, me.start, me.place])
    rows = [torch.empty(4, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    values = [[int(v) for v in row.tolist()] for row in rows]
    return HostPeers(
        tuple(row[0] for row in values),
        dist.get_rank(),
        tuple(ProcessId(row[1], row[2], row[3]) for row in values),
    )

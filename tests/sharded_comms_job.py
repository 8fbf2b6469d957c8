"""One rank of a job of tests/test_sharded_comms.py, started by hand (no torchrun): rank,
world and the store's address in the environment, rank 0 hosting the TCP store.

Usage: python sharded_comms_job.py MODE VICTIM SYNC. Runs sharded_comms_cases.sharded_fault
and prints "rank R result <json>" on stderr (a killed victim prints nothing)."""

from __future__ import annotations

import json
import sys

import sharded_comms_cases
import torch
import torch.distributed as dist


def main(mode: str, victim: int, sync: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = sharded_comms_cases.sharded_fault(rank, world, mode=mode, victim=victim, sync=sync)
    print(f"rank {rank} result {json.dumps(result)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

"""A job's ranks started by hand (no torchrun, which would kill the survivors itself), each a
process of its own over gloo, rank 0 hosting the TCP store: for tests where a rank dies."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import pytest

# Generous: four processes importing torch on a loaded machine.
JOB_TIMEOUT_S = 240


@dataclass
class Ended:
    """How a rank's process ended: its pid, exit code and stderr."""

    pid: int
    code: int
    stderr: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(script: str, world: int, *args: str, timeout_s: float = JOB_TIMEOUT_S) -> list[Ended]:
    """Runs `script` with `args` as every rank of a job of `world`; how each rank ended, in
    rank order. A rank that never ends fails the test (after the others are killed)."""
    port = free_port()
    ranks = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo",
                   OMP_NUM_THREADS="1")  # fmt: skip
        ranks.append(
            subprocess.Popen([sys.executable, script, *args], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )  # fmt: skip
    ended = []
    for rank, process in enumerate(ranks):
        try:
            _, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p in ranks:
                p.kill()
                p.communicate()
            pytest.fail(f"rank {rank} of the job ({script} {' '.join(args)}) never exited")
        ended.append(Ended(process.pid, process.returncode, err))
    return ended

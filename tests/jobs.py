"""A job's ranks started by hand (no torchrun, which would kill the survivors itself), each a
process of its own over gloo, rank 0 hosting the TCP store: for tests where a rank dies or
where how a rank's process ends is the point.

The ranks are forked by one starter process (tests/job_starter.py) that has imported torch
and gpipe_fast already: a rank then costs its own work, not seconds of imports (the 24 jobs
of test_exit_codes.py took minutes). Each rank still runs its script as `python SCRIPT ARGS`
does, and ends as a script's process does."""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Generous: four processes on a loaded machine.
JOB_TIMEOUT_S = 240
STARTER = str(Path(__file__).with_name("job_starter.py"))
# What every rank's environment holds besides its rank, as torchrun would set it up.
JOB_ENV = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


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


class _Starter:
    """The starter process (started at the first job, stopped at exit) and its replies, read
    by a thread of their own so that a wait for one can time out."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, STARTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=dict(os.environ, **JOB_ENV), text=True,
        )  # fmt: skip
        self.replies: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.stop)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.replies.put(line)
        self.replies.put("")  # it ended

    def send(self, request: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def reply(self, timeout_s: float) -> dict[str, list[int]] | None:
        """The next reply, or None when none came within `timeout_s`."""
        try:
            line = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            return None
        assert line, f"the job starter ended (exit code {self.process.wait()})"
        return json.loads(line)  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


_starter: _Starter | None = None


def _the_starter() -> _Starter:
    global _starter
    if _starter is None or _starter.process.poll() is not None:
        _starter = _Starter()
    return _starter


def run_job(script: str, world: int, *args: str, timeout_s: float = JOB_TIMEOUT_S) -> list[Ended]:
    """Runs `script` with `args` as every rank of a job of `world`; how each rank ended, in
    rank order. A rank that never ends fails the test (after the ranks are killed)."""
    starter = _the_starter()
    with tempfile.TemporaryDirectory(prefix="gpipe-job-") as folder:
        env = dict(os.environ, **JOB_ENV, MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world))  # fmt: skip
        request = {"script": script, "args": list(args), "world": world, "env": env,
                   "folder": folder}  # fmt: skip
        starter.send(request)
        started = starter.reply(timeout_s)
        assert started is not None, "the job starter forked no rank"
        pids = started["pids"]
        ended = starter.reply(timeout_s)
        if ended is None:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            starter.reply(60)  # the starter reaps them
            pytest.fail(f"a rank of the job ({script} {' '.join(args)}) never exited")
        return [
            Ended(pid, code, (Path(folder) / f"rank{rank}.err").read_text())
            for rank, (pid, code) in enumerate(zip(pids, ended["codes"], strict=True))
        ]

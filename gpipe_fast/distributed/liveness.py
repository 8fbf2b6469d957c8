"""Whether another rank's process has ended, as its host sees it: its pid, probed."""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessId:
    """A process as another process of its host can probe it: its pid, its start time (clock
    ticks after boot, 0 where unknown: a pid reused by a later process is not it), and where
    that pid means it (a hash of the host, its boot and the pid namespace)."""

    pid: int
    start: int
    place: int


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from its third field on (after the command's name, which may hold
    spaces and parentheses); None when there is no such process (or no /proc)."""
    text = _read(f"/proc/{pid}/stat")
    return text[text.rfind(")") + 2 :].split() if text else None


def this_process() -> ProcessId:
    """This process, for the other ranks."""
    fields = _stat_fields(os.getpid())
    start = int(fields[19]) if fields else 0  # stat's field 22
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    where = f"{socket.gethostname()}|{_read('/proc/sys/kernel/random/boot_id')}|{namespace}"
    place = int.from_bytes(hashlib.blake2b(where.encode(), digest_size=7).digest(), "big")
    return ProcessId(os.getpid(), start, place)


def has_ended(process: ProcessId) -> bool:
    """Whether `process`, of this place, has ended: gone, a zombie its parent has not reaped
    yet, or its pid now another process's."""
    fields = _stat_fields(process.pid)
    if fields is not None:
        state, start = fields[0], int(fields[19])
        return state in ("Z", "X", "x") or (process.start != 0 and start != process.start)
    if os.path.isdir("/proc/self"):
        return True  # /proc has no such pid
    try:  # no /proc: whether the pid exists at all
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@dataclass(frozen=True)
class Processes:
    """Every rank's process, by global rank, as `rank` learnt them at the pipe's build."""

    processes: tuple[ProcessId, ...]
    rank: int

    def ended(self) -> dict[int, int]:
        """The other ranks whose process this host sees ended: rank -> pid. Ranks on other
        hosts (or in another pid namespace) cannot be probed and are never in it."""
        here = self.processes[self.rank].place
        return {
            rank: process.pid
            for rank, process in enumerate(self.processes)
            if rank != self.rank and process.place == here and has_ended(process)
        }

    def probed(self, rank: int) -> bool:
        """Whether this host can see if `rank`'s process has ended."""
        return self.processes[rank].place == self.processes[self.rank].place

"""A rank whose process ended is seen from its host and named by the guard's messages, in one
process: real child processes stand for the other ranks."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from gpipe_fast.distributed import beside
from gpipe_fast.distributed.guard import Guard, PeerFailure
from gpipe_fast.distributed.liveness import Processes, ProcessId, has_ended, this_process


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A process that runs until killed."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process
    process.kill()
    process.wait()


def _as_seen(process: subprocess.Popen[bytes]) -> ProcessId:
    """`process` as its rank would tell the others (its own this_process())."""
    with open(f"/proc/{process.pid}/stat") as file:
        start = int(file.read().rsplit(")", 1)[1].split()[19])
    return ProcessId(process.pid, start, this_process().place)


def _kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILLs it and waits until it is a zombie: its parent (this test) has not reaped it."""
    process.send_signal(signal.SIGKILL)
    for _ in range(6000):
        with open(f"/proc/{process.pid}/stat") as file:
            if file.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    pytest.fail(f"process {process.pid} did not end within a minute of SIGKILL")


def test_a_process_is_running_until_killed_even_unreaped(child: subprocess.Popen[bytes]) -> None:
    seen = _as_seen(child)
    assert not has_ended(seen)
    assert not has_ended(this_process())
    _kill(child)
    assert has_ended(seen)  # a zombie has ended
    child.wait()
    assert has_ended(seen)  # and so has a process that is gone


def test_a_pid_taken_by_another_process_is_not_the_rank(child: subprocess.Popen[bytes]) -> None:
    seen = _as_seen(child)
    assert has_ended(dataclasses.replace(seen, start=seen.start + 1))


def _guard(store: Any, others: list[ProcessId], **kwargs: Any) -> Guard:
    """Rank 0's guard of a job whose ranks 1, 2, ... are `others`."""
    processes = Processes((this_process(), *others), 0)
    return Guard(store, "pipe", 0, 30, peers=len(others), processes=processes, **kwargs)


class _Request:
    """A collective whose connection broke."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        raise self.error


def test_a_broken_collective_names_the_rank_that_died(child: subprocess.Popen[bytes]) -> None:
    # Ranks 1 and 2 of this host: rank 2 dies; rank 0 sees the collective of the three break.
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        store = dist.HashStore()
        guard = _guard(store, [_as_seen(alive), _as_seen(child)])
        _kill(child)
        request = _Request(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))
        with pytest.raises(PeerFailure) as raised:
            guard.wait(request, "a value", group=None)
        expected = f"the step failed on rank 2: died (process {child.pid} ended); rank 0 lost"
        assert expected in str(raised.value)
        # Every rank reads it as rank 2's failure; rank 1 (alive) is waited for, rank 2 not.
        read = Guard(store, "pipe", 1, 30).failure()
        assert read is not None and read.startswith(f"rank 2: died (process {child.pid} ended)")
        assert guard.origin and guard.linger(bound_s=60)
    finally:
        alive.kill()
        alive.wait()


def test_the_origin_does_not_wait_for_a_dead_rank_to_read(child: subprocess.Popen[bytes]) -> None:
    store = dist.HashStore()
    guard = _guard(store, [_as_seen(child)])
    guard.report("ValueError: planted")  # this rank's own failure: the one every rank reads
    _kill(child)
    assert guard.linger(bound_s=60)  # the only other rank is dead: nobody left to wait for


class _GoneStore:
    """The store of a rank that died with it."""

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Connection reset by peer\nException raised from recvBytes")

    def compare_set(self, *args: Any) -> bytes:
        raise RuntimeError("Connection reset by peer")


def test_the_stores_host_is_named_when_it_died(child: subprocess.Popen[bytes]) -> None:
    processes = Processes((_as_seen(child), this_process()), 1)  # rank 0 hosts the store
    guard = Guard(_GoneStore(), "pipe", 1, 30, peers=1, processes=processes)
    _kill(child)
    with pytest.raises(PeerFailure) as raised:
        guard.check()
    assert str(raised.value) == (
        f"gpipe_fast: the step failed on rank 0: died (process {child.pid} ended); the "
        "process group's store stopped answering: Connection reset by peer"
    )


def test_a_broken_channel_to_another_host_names_its_rank() -> None:
    elsewhere = ProcessId(pid=1, start=1, place=this_process().place + 1)  # never probed
    guard = _guard(dist.HashStore(), [elsewhere])
    error = ConnectionError("the channel lost its sender")
    with pytest.raises(PeerFailure, match=r"failed on rank 1: stopped answering \(its host is"):
        guard.poll(lambda _: (_ for _ in ()).throw(error), "a gradient", peer=1)


def test_a_broken_collective_of_several_other_hosts_blames_none() -> None:
    elsewhere = ProcessId(pid=1, start=1, place=this_process().place + 1)
    store = dist.HashStore()
    guard = _guard(store, [elsewhere, elsewhere])
    error = RuntimeError("Connection reset by peer")
    failure = guard.lost("a value", None, error, suspects=(0, 1, 2))
    assert str(failure) == (
        "gpipe_fast: rank 0 lost a value: Connection reset by peer (the connection of one of "
        "ranks 1, 2)"
    )
    assert not store.check(["pipe/failure"])  # nobody named: rank 0's own report will say it


def test_a_lost_connection_beside_the_pipe_is_named(
    child: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    guard = _guard(dist.HashStore(), [_as_seen(child)])
    _kill(child)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)  # no process group here
    named = rf"failed on rank 1: died \(process {child.pid} ended\); rank 0 lost the save"
    with pytest.raises(PeerFailure, match=named), beside.naming_dead_ranks(guard, "the save"):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:41103")


def test_other_errors_beside_the_pipe_pass_as_they_are() -> None:
    guard = _guard(dist.HashStore(), [])
    with pytest.raises(ValueError, match="mine"), beside.naming_dead_ranks(guard, "a save"):
        raise ValueError("mine")
    with pytest.raises(RuntimeError, match="mine"), beside.naming_dead_ranks(None, "a save"):
        raise RuntimeError("mine: Connection reset by peer")

"""Bounded waits: a failure reported by any rank ends every wait; a silent peer, the timeout."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from gpipe_fast.guard import Guard, PeerFailure


class _Store:
    """A process group's store, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


class _Request:
    """A send or receive that completes when told (gloo's: only inside wait())."""

    def __init__(self, error: Exception | None = None) -> None:
        self.released = threading.Event()
        self.error = error

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        self.released.wait()
        if self.error is not None:
            raise self.error


def test_a_completed_wait_returns() -> None:
    guard = Guard(_Store(), "pipe", rank=0, timeout_s=30)
    request = _Request()
    threading.Timer(0.1, request.released.set).start()
    guard.wait(request, "an activation", peer=1)  # returns once the request completes


def test_another_ranks_failure_ends_the_wait() -> None:
    store = _Store()
    waiting, failing = Guard(store, "pipe", 0, 30), Guard(store, "pipe", 1, 30)
    request = _Request()
    threading.Timer(0.1, lambda: failing.report("KeyError: 'planted'")).start()
    with pytest.raises(PeerFailure, match=r"the step failed on rank 1: KeyError: 'planted'"):
        waiting.wait(request, "an activation", peer=1)
    assert not request.released.is_set()  # the request itself never completed
    request.released.set()


def test_a_silent_peer_times_out_naming_it() -> None:
    guard = Guard(_Store(), "pipe", rank=0, timeout_s=0.2)
    request = _Request()
    with pytest.raises(PeerFailure, match=r"rank 0 waited 0.2 s for a gradient from rank 3"):
        guard.wait(request, "a gradient", peer=3)
    request.released.set()


def test_a_lost_connection_is_reported_with_the_peer() -> None:
    guard = Guard(_Store(), "pipe", rank=2, timeout_s=30)
    request = _Request(ConnectionError("Connection closed by peer"))
    request.released.set()
    with pytest.raises(PeerFailure, match=r"rank 2 lost an activation from rank 0: Connection"):
        guard.wait(request, "an activation", peer=0)


def test_the_first_local_report_is_kept() -> None:
    store = _Store()
    guard = Guard(store, "pipe", rank=1, timeout_s=1)
    guard.report("first")
    guard.report("second")
    assert guard.failure() == "rank 1: first"
    assert store.get("pipe/failure") == b"rank 1: first"
    other: Any = Guard(store, "pipe", rank=0, timeout_s=1)
    assert other.failure() == "rank 1: first"

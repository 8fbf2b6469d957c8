"""Bounded waits: a failure reported by any rank ends every wait; a silent peer, the timeout,
which names the rank that did not answer (not the one that waited); a helper thread that
cannot start fails its wait at once."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist
from cluster import Cluster, values

from gpipe_fast.distributed import waiters
from gpipe_fast.distributed.guard import Guard, PeerFailure, _cause, _first_line


def _store() -> Any:
    """A process group's store, in memory (torch's own, with its compare_set and add)."""
    return dist.HashStore()


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
    guard = Guard(_store(), "pipe", rank=0, timeout_s=30)
    request = _Request()
    threading.Timer(0.1, request.released.set).start()
    guard.wait(request, "an activation", peer=1)
    assert request.released.is_set()  # it returned once the request completed, not before
    guard.check()  # and no failure was reported on the way


def test_another_ranks_failure_ends_the_wait() -> None:
    store = _store()
    waiting, failing = Guard(store, "pipe", 0, 30), Guard(store, "pipe", 1, 30)
    request = _Request()
    threading.Timer(0.1, lambda: failing.report("KeyError: 'planted'")).start()
    with pytest.raises(PeerFailure, match=r"the step failed on rank 1: KeyError: 'planted'"):
        waiting.wait(request, "an activation", peer=1)
    assert not request.released.is_set()  # the request itself never completed
    request.released.set()


def test_a_silent_peer_times_out_naming_it() -> None:
    store = _store()
    guard = Guard(store, "pipe", rank=0, timeout_s=0.2)
    request = _Request()
    named = (
        r"^gpipe_fast: the step failed on rank 3: rank 3 did not answer within 0.2 s \(slow, "
        r"stuck or gone\); rank 0 waited for a gradient from rank 3$"
    )
    with pytest.raises(PeerFailure, match=named):
        guard.wait(request, "a gradient", peer=3)
    request.released.set()
    # The slow rank, once it looks, reads that it was the one: not the rank that waited.
    slow = Guard(store, "pipe", rank=3, timeout_s=0.2)
    with pytest.raises(PeerFailure, match=r"failed on rank 3: rank 3 did not answer within"):
        slow.check()


def test_a_timeout_names_the_rank_at_the_end_of_a_chain_of_waits() -> None:
    # Rank 1 waits for rank 0, which waits (for half its timeout already) for rank 2: rank 1
    # times out first, and names rank 2, the one that does not answer, not rank 0.
    store = _store()
    first, second = Guard(store, "pipe", 0, 30), Guard(store, "pipe", 1, 0.2)
    request = _Request()
    threading.Thread(target=lambda: _waits(first, request, peer=2), daemon=True).start()
    first._mark_waiting([2])  # as its wait does past half the timeout
    named = (
        r"the step failed on rank 2: rank 2 did not answer within 0.2 s \(slow, stuck or "
        r"gone\); rank 1 waited for an activation from rank 0; rank 0 for rank 2$"
    )
    with pytest.raises(PeerFailure, match=named):
        second.wait(_Request(), "an activation", peer=0)
    with pytest.raises(PeerFailure, match=named):  # what rank 0 reads too
        first.check()
    request.released.set()


def _waits(guard: Guard, request: _Request, peer: int) -> None:
    with contextlib.suppress(PeerFailure):
        guard.wait(request, "a gradient", peer=peer)


def test_a_wait_past_half_its_timeout_says_whom_it_waits_for() -> None:
    store = _store()
    guard = Guard(store, "pipe", rank=0, timeout_s=0.4)
    request = _Request()
    threading.Timer(0.3, request.released.set).start()
    guard.wait(request, "the batch size", group=None, peer=5)
    assert store.get("pipe/waiting/0") == b""  # said, then unsaid when the wait ended
    assert Guard(store, "pipe", 1, 1)._waits_for(0) == []


def test_a_collectives_rank_that_never_came_is_named() -> None:
    # Ranks 1 and 2 wait in the collective too (they said so): rank 3 never came.
    store = _store()
    for rank in (1, 2):
        Guard(store, "pipe", rank, 30)._mark_waiting([0, 1, 2, 3])
    guard = Guard(store, "pipe", 0, 0.2)
    failure = guard.timed_out("the replicas' losses", None, (0, 1, 2, 3))
    assert "the step failed on rank 3: rank 3 did not answer within 0.2 s" in str(failure)
    # None of them said anything: one of them did not answer, which cannot be told.
    failure = Guard(_store(), "pipe", 0, 0.2).timed_out("a sum", None, (0, 1, 2))
    assert str(failure) == (
        "gpipe_fast: the step failed on one of ranks 1, 2: one of ranks 1, 2 did not answer "
        "within 0.2 s; rank 0 waited for a sum"
    )


def test_a_helper_thread_that_cannot_start_fails_the_wait_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under an address-space cap a thread may die as it starts: the wait that needed it
    # raises (the step fails on every rank) instead of waiting unserved until the timeout.
    monkeypatch.setattr(waiters, "THREAD_START_S", 0.2)
    monkeypatch.setattr(waiters._thread, "start_new_thread", lambda *args: 0)
    guard = Guard(_store(), "pipe", rank=0, timeout_s=300)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="a thread to wait on another rank did not start"):
        guard.wait(_Request(), "an activation", peer=1)
    assert time.monotonic() - start < 100  # far from the timeout


def test_a_thread_that_cannot_start_fails_the_step_on_every_rank_at_once(two: Cluster) -> None:
    # Rank 1's thread does not start within 1 s: its step fails, and so does rank 0's, far
    # sooner than the pipe's timeout (120 s), naming rank 1.
    try:
        (kind0, said0, seconds0), (kind1, said1, _) = values(
            two.run("guard_cases.thread_cannot_start", starts_s=1.0)
        )
    finally:
        two.reset()
    assert kind1 == "RuntimeError" and "a thread to wait on another rank did not start" in said1
    assert kind0 == "PeerFailure"
    assert "the step failed on rank 1: RuntimeError: " in said0
    assert "did not start within 1 s" in said0
    assert seconds0 < 60


def test_each_wait_in_flight_gets_a_helper_thread() -> None:
    guard = Guard(_store(), "pipe", rank=0, timeout_s=30)
    requests = [_Request() for _ in range(8)]
    done: list[int] = []
    threads = [
        threading.Thread(target=lambda r=r, i=i: (guard.wait(r, "a value", peer=1), done.append(i)))
        for i, r in enumerate(requests)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    for request in requests:  # each blocked in its own helper until released
        request.released.set()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(done) == list(range(8))
    assert guard._waiters.started == 8
    guard.close()


def test_a_lost_connection_is_reported_with_the_peer() -> None:
    guard = Guard(_store(), "pipe", rank=2, timeout_s=30)
    request = _Request(ConnectionError("Connection closed by peer"))
    request.released.set()
    with pytest.raises(PeerFailure, match=r"rank 2 lost an activation from rank 0: Connection"):
        guard.wait(request, "an activation", peer=0)


def test_gloos_wording_of_a_broken_connection_is_left_out() -> None:
    raw = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:7080: Connection reset by peer. This is typically caused by a remote "
        "worker hanging or bugs in the application.\nException raised from ..."
    )
    failure = Guard(_store(), "pipe", 3, 30).lost("cell 1's all-gather", None, raw, (1, 3))
    assert str(failure) == (
        "gpipe_fast: the step failed on rank 1: stopped answering; rank 3 lost cell 1's "
        "all-gather: Connection reset by peer"
    )
    other = RuntimeError("[a/b/c.cpp:12] Timed out. This is typically caused by x")
    assert _cause(other) == "Timed out"


def test_the_first_local_report_is_kept() -> None:
    store = _store()
    guard = Guard(store, "pipe", rank=1, timeout_s=1)
    guard.report("first")
    guard.report("second")
    assert guard.failure() == "rank 1: first"
    assert store.get("pipe/failure") == b"0:rank 1: first"  # the step, then the failure
    other: Any = Guard(store, "pipe", rank=0, timeout_s=1)
    assert other.failure() == "rank 1: first"


def test_a_failure_says_which_step_it_ended() -> None:
    store = _store()
    failing, other = Guard(store, "pipe", 1, 1), Guard(store, "pipe", 0, 1)
    failing.step = other.step = 3
    failing.report("ValueError: planted")
    other.step = 4  # the other rank has moved on to its next step
    assert other.failure() == "rank 1: ValueError: planted"
    assert other.failed_step == 3


def test_the_first_failure_of_any_rank_is_what_every_rank_reads() -> None:
    # Rank 3 fails; rank 2's wait ends because of it and rank 2 reports its PeerFailure:
    # every rank, rank 2 included, still reads rank 3's error (not a chain of relays).
    store = _store()
    first, relay, reader = (Guard(store, "pipe", r, 1) for r in (3, 2, 0))
    first.report("ValueError: planted")
    relay.report("PeerFailure: gpipe_fast: the step failed on rank 3: ValueError: planted")
    assert first.origin and not relay.origin
    for guard in (first, relay, reader):
        assert guard.failure() == "rank 3: ValueError: planted"
    assert relay.local is not None and relay.local.startswith("rank 2: PeerFailure")


def test_the_reporting_rank_lingers_until_its_peers_have_read() -> None:
    store = _store()
    failing = Guard(store, "pipe", 0, 1, peers=2)
    readers = [Guard(store, "pipe", r, 1) for r in (1, 2)]
    failing.report("KeyError: 'planted'")
    start = time.monotonic()
    failing.linger(0.3)  # nobody has read it: the bound
    assert time.monotonic() - start >= 0.3
    for reader in readers:
        reader.failure()
        reader.failure()  # read twice, counted once
    start = time.monotonic()
    failing.linger(30)
    assert time.monotonic() - start < 5  # both have read it: at once
    assert int(store.add("pipe/failure-seen", 0)) == 2


def test_a_rank_that_read_the_failure_holds_at_exit_until_the_reporting_rank_is_done() -> None:
    # The store may live in the reader's process: were it to end while the reporting rank
    # still looks in the store, that rank would print torch's C++ trace of a lost connection.
    store = _store()
    failing = Guard(store, "pipe", 1, 1, peers=2)
    reader = Guard(store, "pipe", 0, 1, peers=2, hosts_store=True)
    client, bystander = Guard(store, "pipe", 2, 1), Guard(store, "other", 0, 1, hosts_store=True)
    failing.report("KeyError: 'planted'")
    for guard in (reader, client):
        assert guard.failure() == "rank 1: KeyError: 'planted'"
    start = time.monotonic()
    assert not reader.hold(0.3)  # the reporting rank has not lingered yet: the bound
    assert time.monotonic() - start >= 0.3
    assert bystander.hold(30)  # it read no failure: at once
    assert client.hold(30)  # it does not host the store: at once
    assert failing.linger(30)  # its reader has read it
    start = time.monotonic()
    assert reader.hold(30)
    assert time.monotonic() - start < 5  # released: at once


def test_a_rank_that_did_not_start_the_failure_does_not_linger() -> None:
    store = _store()
    Guard(store, "pipe", 1, 1).report("ValueError: first")
    second = Guard(store, "pipe", 0, 1, peers=5)
    second.report("PeerFailure: relayed")
    start = time.monotonic()
    second.linger(30)
    assert time.monotonic() - start < 1


def test_store_errors_lose_their_cpp_trace() -> None:
    error = RuntimeError("Connection reset by peer\nException raised from recvBytes at x.cpp:1")
    assert _first_line(error) == "Connection reset by peer"


def test_a_restarted_jobs_failures_are_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun --max-restarts keeps its store: the failed attempt's failure stays in it, and
    # must not end the steps of the attempt that follows.
    from gpipe_fast.distributed import process_groups

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = process_groups._attempt()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert process_groups._attempt() != first
    store = _store()
    Guard(store, f"gpipe_fast/attempt{first}/pipe0", 1, 1).report("ValueError: old")
    restarted = Guard(store, f"gpipe_fast/attempt{process_groups._attempt()}/pipe0", 0, 1)
    assert restarted.failure() is None


class _Channel:
    """A receive done on the caller's thread (a shared-memory ring's): TimeoutError for the
    first `empty` slices, then the message, or `error` once it is set."""

    def __init__(self, empty: int = 0) -> None:
        self.empty = empty
        self.calls: list[float] = []
        self.error: Exception | None = None

    def receive(self, seconds: float) -> str:
        self.calls.append(seconds)
        time.sleep(seconds / 10)
        if self.error is not None:
            raise self.error
        if len(self.calls) <= self.empty:
            raise TimeoutError("nothing yet")
        return "message"


def test_a_poll_returns_what_came_after_empty_slices() -> None:
    channel = _Channel(empty=3)
    guard = Guard(_store(), "pipe", rank=0, timeout_s=30)
    assert guard.poll(channel.receive, "an activation", peer=1) == "message"
    assert len(channel.calls) == 4 and max(channel.calls) <= 0.05  # short slices


def test_another_ranks_failure_ends_a_poll() -> None:
    store = _store()
    polling, failing = Guard(store, "pipe", 0, 30), Guard(store, "pipe", 1, 30)
    threading.Timer(0.1, lambda: failing.report("KeyError: 'planted'")).start()
    with pytest.raises(PeerFailure, match=r"the step failed on rank 1: KeyError: 'planted'"):
        polling.poll(_Channel(empty=10**9).receive, "an activation", peer=1)


def test_a_silent_peer_times_out_a_poll_as_a_wait() -> None:
    guard = Guard(_store(), "pipe", rank=0, timeout_s=0.2)
    with pytest.raises(PeerFailure, match=r"rank 3 did not answer within 0.2 s \(slow, stuck"):
        guard.poll(_Channel(empty=10**9).receive, "a gradient", peer=3)


def test_a_closed_channel_names_the_origin_of_the_failure_or_the_peer() -> None:
    store = _store()
    guard = Guard(store, "pipe", 0, 30)
    channel = _Channel()
    channel.error = ConnectionError("the sending process died\ntrace")
    Guard(store, "pipe", 2, 30).report("ValueError: first")  # it closed its rings after this
    with pytest.raises(PeerFailure, match=r"the step failed on rank 2: ValueError: first"):
        guard.poll(channel.receive, "a skip", peer=2)
    # Nothing reported: the peer stopped answering, and every rank reads that it did.
    alone = Guard(_store(), "pipe", 0, 30)
    said = "the step failed on rank 2: stopped answering; rank 0 lost a skip from rank 2: the "
    with pytest.raises(PeerFailure, match=rf"^gpipe_fast: {said}sending process died$"):
        alone.poll(channel.receive, "a skip", peer=2)

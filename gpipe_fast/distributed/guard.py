"""Bounded waits for a multi-process step, and one failure carried to every rank."""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from gpipe_fast import _C

# How often a waiting rank looks in the store for another rank's failure.
CHECK_EVERY_S = 0.05
# How long, at most, the rank whose failure the others read stays at exit until they have
# read it (the store may live in its process and end with it).
LINGER_S = 10.0

T = TypeVar("T")

# A wait on another rank cannot be cancelled, so a helper thread may still be blocked in one
# when Python shuts down; were it to return then, the process would abort (exit_guard.hpp).
# It parks instead, and the process keeps its own exit code. Registered first, so that it runs
# after every other atexit handler of the package (pipes closed, failures read).
_C.install_exit_guard()
atexit.register(_C.interpreter_exiting)


class PeerFailure(RuntimeError):
    """Another rank's step failed, or a rank stopped answering: this rank's step stops too."""


def _first_line(error: BaseException) -> str:
    """An error's message without the C++ trace torch's store errors carry."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _wait_all(requests: Sequence[Any]) -> None:
    for request in requests:
        request.wait()


class _Waiting:
    """One submission to the waiters: done once its requests are, with their error if any."""

    def __init__(self, requests: Sequence[Any]) -> None:
        self.requests = requests
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Waiters:
    """Daemon threads that wait for requests, so that a wait that never ends (a peer that
    stopped sending) holds up neither its caller nor the interpreter's exit."""

    def __init__(self, threads: int) -> None:
        self.queue: queue.Queue[_Waiting] = queue.Queue()
        for index in range(threads):
            thread = threading.Thread(
                target=self._serve, name=f"gpipe-comm-wait-{index}", daemon=True
            )
            thread.start()

    def _serve(self) -> None:
        while True:
            waiting = self.queue.get()
            try:
                _wait_all(waiting.requests)
            except BaseException as error:
                waiting.error = error
            finally:
                waiting.done.set()

    def submit(self, requests: Sequence[Any]) -> _Waiting:
        waiting = _Waiting(requests)
        self.queue.put(waiting)
        return waiting


class Guard:
    """Every communication wait of a pipe's steps goes through `wait`: the requests are
    waited for on a helper thread (gloo's send and receive requests only make progress in
    wait(), and a wait cannot be interrupted), while the caller looks in the process
    group's store for a failure any rank reported (`report`) and gives up after
    `timeout_s`. So a failure anywhere ends the step on every rank within about the
    timeout, and a rank that died makes the others raise, not hang. A wait given up leaves
    its helper thread blocked until the process group is destroyed (after a failed step,
    see FAILED_STEP_ADVICE).

    The first failure reported by any rank is the one every rank reads: a rank that fails
    because another did (its wait ended) cannot hide where the failure started. The rank
    that reported it stays at exit until the `peers` other ranks have read it, for at most
    LINGER_S: the store may live in its process."""

    def __init__(
        self, store: Any, prefix: str, rank: int, timeout_s: float, peers: int = 0
    ) -> None:
        self.store = store
        self.key = f"{prefix}/failure"
        self.seen_key = f"{prefix}/failure-seen"
        self.rank = rank
        self.timeout_s = timeout_s
        self.peers = peers
        self.local: str | None = None  # this rank's own failure, once reported
        # The pipe's steps so far on this rank (the same count on every rank: each step is
        # every rank's), and the step of the failure that failure() last read.
        self.step = 0
        self.failed_step = 0
        self.origin = False  # this rank's report is the failure every rank reads
        self.seen = False  # this rank has read another rank's failure (and said so)
        self._waiters = _Waiters(4)
        _lingering.add(self)

    def report(self, message: str) -> None:
        """Tells every rank that this one failed, unless a rank reported a failure first
        (this rank's first report is kept locally either way)."""
        if self.local is not None:
            return
        self.local = f"rank {self.rank}: {message}"
        record = f"{self.step}:{self.local}"  # which step failed, then where and why
        try:
            stored = self.store.compare_set(self.key, "", record)
            self.origin = bytes(stored).decode(errors="replace") == record
        except Exception:  # a store that is gone: the others will time out instead
            pass

    def failure(self) -> str | None:
        """The failure every rank reads (the first reported), this rank's own when the
        store cannot be reached, or None."""
        self.failed_step = self.step  # this rank's own failure is of its current step
        try:
            if not self.store.check([self.key]):
                return self.local
            record = bytes(self.store.get(self.key)).decode(errors="replace")
            step, _, message = record.partition(":")
            self.failed_step = int(step)
            if not (self.seen or self.origin):
                self.seen = True
                self.store.add(self.seen_key, 1)  # the reporting rank may leave now
            return message
        except Exception as error:  # the store's server (rank 0) is gone
            if self.local is not None:
                return self.local
            store_error = _first_line(error)
            return f"a rank that stopped answering (the process group's store: {store_error})"

    def linger(self, bound_s: float = LINGER_S) -> None:
        """Returns once every peer has read this rank's failure, or after `bound_s`; at once
        when the failure the ranks read is not this rank's."""
        deadline = time.monotonic() + bound_s
        while self.origin and time.monotonic() < deadline:
            try:
                if int(self.store.add(self.seen_key, 0)) >= self.peers:
                    return
            except Exception:  # the store is gone: nobody can read it any more
                return
            time.sleep(CHECK_EVERY_S)

    def check(self) -> None:
        message = self.failure()
        if message is not None:
            raise PeerFailure(f"gpipe_fast: the step failed on {message}")

    def wait(self, request: Any, what: str, peer: int | None = None) -> None:
        """Waits for a torch.distributed request, or a list of them (`what` names them for
        the messages)."""
        requests: list[Any] = list(request) if isinstance(request, (list, tuple)) else [request]
        if all(r.is_completed() for r in requests):
            _wait_all(requests)  # done (NCCL and collectives report it): raise their errors
            return
        waiting = self._waiters.submit(requests)
        start = time.monotonic()
        while not waiting.done.wait(CHECK_EVERY_S):
            self.check()
            if time.monotonic() - start > self.timeout_s:
                raise self.timed_out(what, peer)
        if waiting.error is not None:
            self.check()  # a failure reported elsewhere explains it best
            raise self.lost(what, peer, waiting.error) from waiting.error

    def poll(self, attempt: Callable[[float], T], what: str, peer: int | None = None) -> T:
        """`attempt(seconds)`'s result, waited for on this thread in slices: `attempt` waits
        at most `seconds` and raises TimeoutError when nothing came (it is called again after
        a look for another rank's failure), ConnectionError when the other end closed or
        died. Bounded by the timeout, like `wait`, with the same messages."""
        start = time.monotonic()
        while True:
            try:
                return attempt(CHECK_EVERY_S)
            except TimeoutError:
                self.check()
                if time.monotonic() - start > self.timeout_s:
                    raise self.timed_out(what, peer) from None
            except ConnectionError as error:
                self.check()  # the failure that closed the channel, as its rank reported it
                raise self.lost(what, peer, error) from error

    def timed_out(self, what: str, peer: int | None) -> PeerFailure:
        source = "" if peer is None else f" from rank {peer}"
        return PeerFailure(
            f"gpipe_fast: rank {self.rank} waited {self.timeout_s:g} s for {what}{source}; "
            "that rank failed or died (or the ranks run different programs: same model, "
            "balance, chunks and schedule everywhere?)"
        )

    def lost(self, what: str, peer: int | None, error: BaseException) -> PeerFailure:
        source = "" if peer is None else f" from rank {peer}"
        return PeerFailure(
            f"gpipe_fast: rank {self.rank} lost {what}{source}: {_first_line(error)}"
        )


# Guards whose failure other ranks may still have to read when the process exits.
_lingering: weakref.WeakSet[Guard] = weakref.WeakSet()


@atexit.register
def _linger_at_exit() -> None:
    for guard in list(_lingering):
        guard.linger()

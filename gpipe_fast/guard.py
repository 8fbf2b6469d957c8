"""Bounded waits for a multi-process step, and one failure carried to every rank."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

# How often a waiting rank looks in the store for another rank's failure.
CHECK_EVERY_S = 0.05


class PeerFailure(RuntimeError):
    """Another rank's step failed, or a rank stopped answering: this rank's step stops too."""


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
    see FAILED_STEP_ADVICE)."""

    def __init__(self, store: Any, prefix: str, rank: int, timeout_s: float) -> None:
        self.store = store
        self.key = f"{prefix}/failure"
        self.rank = rank
        self.timeout_s = timeout_s
        self.local: str | None = None  # this rank's own failure, once reported
        self._waiters = _Waiters(4)

    def report(self, message: str) -> None:
        """Tells every rank that this one failed (first report wins locally)."""
        if self.local is None:
            self.local = message
            try:
                self.store.set(self.key, f"rank {self.rank}: {message}")
            except Exception:  # a store that is gone: the others will time out instead
                pass

    def failure(self) -> str | None:
        """The reported failure of any rank, or None."""
        if self.local is not None:
            return f"rank {self.rank}: {self.local}"
        try:
            if self.store.check([self.key]):
                return bytes(self.store.get(self.key)).decode(errors="replace")
        except Exception as error:  # the store's server (rank 0) is gone
            return f"a rank that stopped answering (the process group's store: {error})"
        return None

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
        source = "" if peer is None else f" from rank {peer}"
        while not waiting.done.wait(CHECK_EVERY_S):
            self.check()
            if time.monotonic() - start > self.timeout_s:
                raise PeerFailure(
                    f"gpipe_fast: rank {self.rank} waited {self.timeout_s:g} s for {what}"
                    f"{source}; that rank failed or died (or the ranks run different "
                    "programs: same model, balance, chunks and schedule everywhere?)"
                )
        if waiting.error is not None:
            self.check()  # a failure reported elsewhere explains it best
            raise PeerFailure(
                f"gpipe_fast: rank {self.rank} lost {what}{source}: {waiting.error}"
            ) from waiting.error

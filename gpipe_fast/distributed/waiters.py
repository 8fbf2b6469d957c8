"""Helper threads that wait on other ranks' requests, so that no wait holds up its caller."""

from __future__ import annotations

import _thread
import queue
import threading
from collections.abc import Sequence
from typing import Any

# How long a helper thread of the waits may take to start before the wait that needed it
# fails (under an address-space cap a thread may not get its stack, or die as it starts).
THREAD_START_S = 10.0


def wait_all(requests: Sequence[Any]) -> None:
    for request in requests:
        request.wait()


class Waiting:
    """One submission to the waiters: done once its requests are, with their error if any."""

    def __init__(self, requests: Sequence[Any]) -> None:
        self.requests = requests
        self.done = threading.Event()
        self.error: BaseException | None = None


class Waiters:
    """Helper threads that wait for requests, so that a wait that never ends (a peer that
    stopped sending) holds up neither its caller nor the interpreter's exit. A thread is
    started when a submission finds none free (so each wait in flight has one), and must say
    it started within THREAD_START_S: one that cannot start (no memory for its stack, or it
    died as it began) fails the wait that needed it at once, which fails the step on every
    rank, instead of leaving that wait unserved until the timeout. (Plain threads of _thread:
    threading's start() would wait for ever for a thread that died as it began.)"""

    def __init__(self) -> None:
        # None tells a thread to end (see close).
        self.queue: queue.Queue[Waiting | None] = queue.Queue()
        self.lock = threading.Lock()
        self.free = 0  # threads waiting for a submission, less the submissions queued
        self.started = 0

    def _serve(self, started: threading.Event) -> None:
        started.set()
        while True:
            waiting = self.queue.get()
            if waiting is None:
                return
            try:
                wait_all(waiting.requests)
            except BaseException as error:
                waiting.error = error
            with self.lock:  # free before its waiter hears: the next wait finds this thread
                self.free += 1
            waiting.done.set()

    def submit(self, requests: Sequence[Any]) -> Waiting:
        with self.lock:
            if self.free > 0:
                self.free -= 1
            else:
                self._start()
        waiting = Waiting(requests)
        self.queue.put(waiting)
        return waiting

    def _start(self) -> None:
        """One more thread, which takes the submission being made (caller holds the lock)."""
        started = threading.Event()
        _thread.start_new_thread(self._serve, (started,))  # RuntimeError if it cannot
        if not started.wait(THREAD_START_S):
            raise RuntimeError(
                f"gpipe_fast: a thread to wait on another rank did not start within "
                f"{THREAD_START_S:g} s (out of memory?)"
            )
        self.started += 1

    def close(self) -> None:
        """Ends the threads without waiting for them: an idle one at once, one still blocked
        in a wait given up (a failed step) once that wait ends."""
        with self.lock:
            for _ in range(self.started):
                self.queue.put(None)
            self.started = self.free = 0

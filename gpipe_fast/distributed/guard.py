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
from gpipe_fast.distributed.liveness import Processes

# How often a waiting rank looks in the store for another rank's failure.
CHECK_EVERY_S = 0.05
# How long, at most, the rank whose failure the others read stays at exit until they have
# read it (the store may live in its process and end with it).
LINGER_S = 10.0
# How long a broken connection waits to see its other end's process end: a dying process's
# sockets close an instant before its pid shows it ended.
DEATH_GRACE_S = 0.2

T = TypeVar("T")

# A wait on another rank cannot be cancelled, so a helper thread may still be blocked in one
# when Python shuts down; were it to return then, the process would abort (exit_guard.hpp).
# It parks instead, and the process keeps its own exit code. Registered first, so that it runs
# after every other atexit handler of the package (pipes closed, failures read).
_C.install_exit_guard()
atexit.register(_C.interpreter_exiting)


class PeerFailure(RuntimeError):
    """Another rank's step failed, or a rank stopped answering: this rank's step stops too."""


def _group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group (none for None)."""
    if group is None:
        return ()
    import torch.distributed as dist  # only where there are groups

    return tuple(dist.get_process_group_ranks(group))


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
        # None tells a thread to end (see close).
        self.queue: queue.Queue[_Waiting | None] = queue.Queue()
        self.threads = threads
        for index in range(threads):
            thread = threading.Thread(
                target=self._serve, name=f"gpipe-comm-wait-{index}", daemon=True
            )
            thread.start()

    def _serve(self) -> None:
        while True:
            waiting = self.queue.get()
            if waiting is None:
                return
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

    def close(self) -> None:
        """Ends the threads without waiting for them: an idle one at once, one still blocked
        in a wait given up (a failed step) once that wait ends."""
        for _ in range(self.threads):
            self.queue.put(None)


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
    LINGER_S: the store may live in its process. A rank that stopped answering is not waited
    for: the guard knows every rank's process (`processes`), so that a rank of this host that
    died is named, wherever the news of it comes from (a broken channel, the store gone)."""

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        timeout_s: float,
        peers: int = 0,
        processes: Processes | None = None,
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
        self.processes = processes
        # Ranks this one found dead or silent: they will not read a failure.
        self.gone: set[int] = set()
        self._waiters = _Waiters(4)
        _lingering.add(self)

    def report(self, message: str, rank: int | None = None) -> None:
        """Tells every rank that this one failed (or that `rank` did: it died), unless a
        rank reported a failure first (this rank's first report is kept locally either
        way)."""
        if self.local is not None:
            return
        self.local = f"rank {self.rank if rank is None else rank}: {message}"
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
        except Exception as error:  # the store's server (rank 0's process, say) is gone
            if self.local is not None:
                return self.local
            store = f"the process group's store stopped answering: {_first_line(error)}"
            dead = self._dead()
            if dead is not None:
                return f"rank {dead[0]}: {dead[1]}; {store}"
            if self.processes is not None:
                store += "; no rank of this host died"
            return f"a rank that stopped answering ({store})"

    def _ended(self, grace_s: float = 0.0) -> dict[int, int]:
        """The ranks of this host whose process has ended: rank -> pid (looked for again
        for up to `grace_s` while none has)."""
        if self.processes is None:
            return {}
        deadline = time.monotonic() + grace_s
        ended = self.processes.ended()
        while not ended and time.monotonic() < deadline:
            time.sleep(0.01)
            ended = self.processes.ended()
        self.gone |= set(ended)
        return ended

    def _dead(self, suspects: Sequence[int] = (), silent: bool = True) -> tuple[int, str] | None:
        """(rank, how it ended) of the rank to blame for a lost connection: a rank of this
        host whose process ended (one of `suspects`, the ranks at the other end, first),
        else (with `silent`) the one other rank at the other end. None when neither is
        known: the other end is a group of several ranks, none of this host dead."""
        ended = self._ended(DEATH_GRACE_S)
        if ended:
            first = min(ended, key=lambda r: (r not in suspects, r))
            how = f"died (process {ended[first]} ended)"
            also = [f"rank {r} (process {pid})" for r, pid in sorted(ended.items()) if r != first]
            return first, how + (f"; so did {', '.join(also)}" if also else "")
        others = sorted(set(suspects) - {self.rank})
        if not silent or len(others) != 1:
            return None
        (other,) = others
        if self.processes is not None and self.processes.probed(other):
            return other, "stopped answering (its process still runs)"  # it may still read
        self.gone.add(other)
        if self.processes is None:
            return other, "stopped answering"
        return other, "stopped answering (its host is another: its process cannot be seen)"

    def linger(self, bound_s: float | None = None) -> bool:
        """Returns once every peer still running has read this rank's failure (True), or
        after `bound_s` (LINGER_S by default: False); at once when the failure the ranks read
        is not this rank's, or the store is gone. A rank found dead or silent (`gone`) is
        not waited for."""
        deadline = time.monotonic() + (LINGER_S if bound_s is None else bound_s)
        while self.origin and time.monotonic() < deadline:
            try:
                self._ended()
                if int(self.store.add(self.seen_key, 0)) >= self.peers - len(self.gone):
                    return True
            except Exception:  # the store is gone: nobody can read it any more
                return True
            time.sleep(CHECK_EVERY_S)
        return not self.origin

    def close(self) -> None:
        """Ends the helper threads of the waits (the pipe is closed: no step waits again).
        A failure this rank reported is still read at exit by the other ranks (linger)."""
        self._waiters.close()

    def check(self) -> None:
        message = self.failure()
        if message is not None:
            raise PeerFailure(f"gpipe_fast: the step failed on {message}")

    def wait(self, request: Any, what: str, peer: int | None = None, group: Any = None) -> None:
        """Waits for a torch.distributed request, or a list of them (`what` names them for
        the messages; `peer` is the rank they come from, `group` the process group of a
        collective: where a lost connection may lead)."""
        requests: list[Any] = list(request) if isinstance(request, (list, tuple)) else [request]
        if all(r.is_completed() for r in requests):
            _wait_all(requests)  # done (NCCL and collectives report it): raise their errors
            return
        waiting = self._waiters.submit(requests)
        suspects = _group_ranks(group) or (() if peer is None else (peer,))
        start = time.monotonic()
        while not waiting.done.wait(CHECK_EVERY_S):
            self.check()
            if time.monotonic() - start > self.timeout_s:
                raise self.timed_out(what, peer)
        if waiting.error is not None:
            self.check()  # a failure reported elsewhere explains it best
            raise self.lost(what, peer, waiting.error, suspects) from waiting.error

    def poll(
        self,
        attempt: Callable[[float], T],
        what: str,
        peer: int | None = None,
        suspects: Sequence[int] = (),
    ) -> T:
        """`attempt(seconds)`'s result, waited for on this thread in slices: `attempt` waits
        at most `seconds` and raises TimeoutError when nothing came (it is called again after
        a look for another rank's failure), ConnectionError when the other end (`peer`, or
        one of `suspects`) closed or died. Bounded by the timeout, like `wait`, with the same
        messages."""
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
                raise self.lost(what, peer, error, suspects) from error

    def timed_out(self, what: str, peer: int | None) -> PeerFailure:
        source = "" if peer is None else f" from rank {peer}"
        waited = f"rank {self.rank} waited {self.timeout_s:g} s for {what}{source}"
        dead = self._dead(() if peer is None else (peer,), silent=False)
        if dead is not None:  # a rank of this host died: it is why
            return self._blame(dead, waited)
        return PeerFailure(
            f"gpipe_fast: {waited}; that rank failed or died (or the ranks run different "
            "programs: same model, balance, chunks and schedule everywhere?)"
        )

    def lost(
        self, what: str, peer: int | None, error: BaseException, suspects: Sequence[int] = ()
    ) -> PeerFailure:
        """The error of a connection to another rank that broke (`error`): `peer`, the rank
        it led to, or one of `suspects`. A rank found dead (or the one rank at the other end)
        is reported as the failure every rank reads, with what this rank saw."""
        source = "" if peer is None else f" from rank {peer}"
        suspects = suspects or (() if peer is None else (peer,))
        lost = f"rank {self.rank} lost {what}{source}: {_first_line(error)}"
        dead = self._dead(suspects)
        if dead is not None:
            return self._blame(dead, lost)
        others = sorted(set(suspects) - {self.rank})
        if len(others) > 1:  # a collective's group: any of them may have gone
            lost += f" (the connection of one of ranks {', '.join(map(str, others))})"
        return PeerFailure(f"gpipe_fast: {lost}")

    def _blame(self, dead: tuple[int, str], seen: str) -> PeerFailure:
        """Reports `dead` (a rank, how it ended: see _dead) as the step's failure, with what
        this rank `seen`; the failure every rank reads, as a PeerFailure (an earlier report
        wins)."""
        self.report(f"{dead[1]}; {seen}", rank=dead[0])
        return PeerFailure(f"gpipe_fast: the step failed on {self.failure() or self.local}")


# Guards whose failure other ranks may still have to read when the process exits.
_lingering: weakref.WeakSet[Guard] = weakref.WeakSet()


@atexit.register
def _linger_at_exit() -> None:
    for guard in list(_lingering):
        guard.linger()

"""Bounded waits for a multi-process step, and one failure carried to every rank."""

from __future__ import annotations

import atexit
import re
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from gpipe_fast import _C
from gpipe_fast.distributed.liveness import Processes
from gpipe_fast.distributed.waiters import Waiters, wait_all
from gpipe_fast.errors import PeerFailure as PeerFailure  # its home before errors.py

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


# Gloo's wording of a connection error: "[.../pair.cc:537] Read error [127.0.0.1]:7080:
# Connection reset by peer. This is typically caused by ..." (the source line, then the peer's
# address, then advice about the remote worker).
_GLOO_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h)(?::\d+)?\]\s*")
_GLOO_ADVICE = re.compile(r"\.?\s*This is typically caused by.*$")
# How gloo (and the store) word a connection the other end's death broke.
LOST_CONNECTION = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _cause(error: BaseException) -> str:
    """What a broken connection's error says: how it broke, without gloo's source line,
    addresses and advice."""
    line = _first_line(error)
    lost = next((text for text in LOST_CONNECTION if text in line), None)
    if lost is not None:
        return lost
    return _GLOO_ADVICE.sub("", _GLOO_SOURCE.sub("", line)) or type(error).__name__


def _ranks(ranks: Sequence[int]) -> str:
    """The ranks in words: rank 3, or ranks 1, 2."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))


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
    LINGER_S: the store may live in its process. The rank whose process hosts the store
    (`hosts_store`), when it read the failure, stays at exit in turn until the reporting rank
    is done with the store (`hold`), for at most LINGER_S too: an operation on a store that
    is gone prints torch's C++ trace of a lost connection. A rank that stopped answering is
    not waited for: the guard knows every rank's process (`processes`), so that a rank of
    this host that died is named, wherever the news of it comes from (a broken channel, the
    store gone).

    A wait that times out names the rank that did not answer, not the one that waited: a
    rank whose wait has lasted half the timeout says in the store whom it waits for, so that
    a rank that times out waiting for it names the rank at the end of that chain (the slow
    one), and the slow rank, once it wakes, reads that it was named."""

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        timeout_s: float,
        peers: int = 0,
        processes: Processes | None = None,
        hosts_store: bool = False,
    ) -> None:
        self.store = store
        self.hosts_store = hosts_store
        self.key = f"{prefix}/failure"
        self.seen_key = f"{prefix}/failure-seen"
        self.released_key = f"{prefix}/failure-released"  # the reporting rank is done
        self.waiting_prefix = f"{prefix}/waiting"  # /<rank>: whom that rank waits for
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
        self._waiters = Waiters()
        _lingering.add(self)

    def report(self, message: str, rank: int | str | None = None) -> None:
        """Tells every rank that this one failed (or that `rank` did: it died or did not
        answer; a str names several ranks), unless a rank reported a failure first (this
        rank's first report is kept locally either way)."""
        if self.local is not None:
            return
        who = rank if isinstance(rank, str) else f"rank {self.rank if rank is None else rank}"
        self.local = f"{who}: {message}"
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
                    self._release()
                    return True
            except Exception:  # the store is gone: nobody can read it any more
                return True
            time.sleep(CHECK_EVERY_S)
        if self.origin:
            self._release()  # the ranks that did read it need not wait any longer
        return not self.origin

    def _release(self) -> None:
        """Says that this rank, the failure's origin, will not use the store again."""
        try:
            self.store.set(self.released_key, "1")
        except Exception:  # the store is gone: nobody waits for this any more
            pass

    def hold(self, bound_s: float | None = None) -> bool:
        """Returns once the rank whose failure this one read is done with the store (True),
        or after `bound_s` (LINGER_S by default: False); at once on a rank that does not host
        the store or read no other rank's failure, or when the store is gone. Ended before
        the reporting rank's last look in the store, this process would take the store with
        it, and that rank would print torch's C++ trace of a lost connection."""
        holds = self.seen and self.hosts_store
        deadline = time.monotonic() + (LINGER_S if bound_s is None else bound_s)
        while holds and time.monotonic() < deadline:
            if self.processes is not None and len(self._ended()) >= self.peers:
                return True  # every other rank's process ended: none will use the store
            try:
                if self.store.check([self.released_key]):
                    return True
            except Exception:  # the store is gone already
                return True
            time.sleep(CHECK_EVERY_S)
        return not holds

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
            wait_all(requests)  # done (NCCL and collectives report it): raise their errors
            return
        waiting = self._waiters.submit(requests)
        suspects = _group_ranks(group) or (() if peer is None else (peer,))
        with self._watch(what, peer, suspects) as watch:
            while not waiting.done.wait(CHECK_EVERY_S):
                watch()
        error = waiting.error
        if error is not None:
            self.check()  # a failure reported elsewhere explains it best
            if isinstance(error, TimeoutError) or "timed out" in _first_line(error).lower():
                # The group's own timeout (a sharded cell's is the pipe's) came first.
                raise self.timed_out(what, peer, suspects) from error
            raise self.lost(what, peer, error, suspects) from error

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
        with self._watch(what, peer, suspects or (() if peer is None else (peer,))) as watch:
            while True:
                try:
                    return attempt(CHECK_EVERY_S)
                except TimeoutError:
                    watch()
                except ConnectionError as error:
                    self.check()  # the failure that closed the channel, as its rank reported it
                    raise self.lost(what, peer, error, suspects) from error

    @contextmanager
    def _watch(
        self, what: str, peer: int | None, suspects: Sequence[int]
    ) -> Iterator[Callable[[], None]]:
        """A wait's look between its slices: raises another rank's failure, or at the timeout
        the one naming the rank that did not answer; past half the timeout, says in the store
        whom this rank waits for (until the wait ends)."""
        start = time.monotonic()
        marked = False

        def look() -> None:
            nonlocal marked
            self.check()
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                raise self.timed_out(what, peer, suspects)
            if not marked and waited > self.timeout_s / 2 and suspects:
                marked = self._mark_waiting(suspects)

        try:
            yield look
        finally:
            if marked:
                self._mark_waiting(())

    def _mark_waiting(self, ranks: Sequence[int]) -> bool:
        """Says in the store whom this rank waits for (nobody: ())."""
        try:
            self.store.set(f"{self.waiting_prefix}/{self.rank}", ",".join(map(str, ranks)))
            return True
        except Exception:  # the store is gone: the wait's own end will say why
            return False

    def _waits_for(self, rank: int) -> list[int]:
        """The ranks `rank` has said it waits for (none: it is not waiting, or not yet)."""
        key = f"{self.waiting_prefix}/{rank}"
        try:
            if not self.store.check([key]):
                return []
            text = bytes(self.store.get(key)).decode(errors="replace")
        except Exception:
            return []
        return [int(r) for r in text.split(",") if r.strip()]

    def _silent(self, suspects: Sequence[int]) -> tuple[list[int], list[int]]:
        """(the ranks among `suspects` that did not answer, the ranks in between): of several
        (a collective's), those that do not wait themselves; a suspect that waits for another
        rank passes the blame on to that rank, along the chain of waits, until a rank that
        waits for nobody (or a cycle, or several)."""
        others = sorted(set(suspects) - {self.rank})
        between: list[int] = []
        seen = {self.rank}
        while others:
            if len(others) > 1:  # a collective's ranks: those that arrived wait in it too
                idle = [rank for rank in others if not self._waits_for(rank)]
                others = idle or others
                if len(others) > 1:
                    break
            (rank,) = others
            if rank in seen:
                break
            seen.add(rank)
            further = sorted(set(self._waits_for(rank)) - seen)
            if not further:
                break
            between.append(rank)
            others = further
        return others, between

    def timed_out(self, what: str, peer: int | None, suspects: Sequence[int] = ()) -> PeerFailure:
        """The failure of a wait that reached the timeout: a rank of this host that died,
        else the rank that did not answer (reported as the failure every rank reads, so that
        it is the one named everywhere, itself included), or the ranks one of which did not."""
        suspects = suspects or (() if peer is None else (peer,))
        source = "" if peer is None else f" from rank {peer}"
        dead = self._dead(suspects, silent=False)
        if dead is not None:  # a rank of this host died: it is why
            waited = f"rank {self.rank} waited {self.timeout_s:g} s for {what}{source}"
            return self._blame(dead, waited)
        silent, between = self._silent(suspects)
        waited = f"rank {self.rank} waited for {what}{source}"
        for index, rank in enumerate(between):  # the chain of waits, to the silent rank
            after = between[index + 1 : index + 2] or silent
            waited += f"; rank {rank} for {_ranks(after)}"
        within = f"within {self.timeout_s:g} s"
        if not silent:  # nobody at the other end to name: this rank's own failure
            return PeerFailure(f"gpipe_fast: {waited}: nothing came {within}")
        if len(silent) > 1:  # one of a collective's ranks: which one cannot be told
            named = f"one of {_ranks(silent)}"
            self.report(f"{named} did not answer {within}; {waited}", named)
            return PeerFailure(f"gpipe_fast: the step failed on {self.failure() or self.local}")
        (rank,) = silent
        if self.processes is None:
            state = "slow, stuck or gone"
        elif self.processes.probed(rank):
            state = "its process still runs: slow or stuck"
        else:
            state = "its host is another: whether its process runs cannot be seen"
        return self._blame((rank, f"rank {rank} did not answer {within} ({state})"), waited)

    def lost(
        self, what: str, peer: int | None, error: BaseException, suspects: Sequence[int] = ()
    ) -> PeerFailure:
        """The error of a connection to another rank that broke (`error`): `peer`, the rank
        it led to, or one of `suspects`. A rank found dead (or the one rank at the other end)
        is reported as the failure every rank reads, with what this rank saw."""
        source = "" if peer is None else f" from rank {peer}"
        suspects = suspects or (() if peer is None else (peer,))
        lost = f"rank {self.rank} lost {what}{source}: {_cause(error)}"
        dead = self._dead(suspects)
        if dead is not None:
            return self._blame(dead, lost)
        others = sorted(set(suspects) - {self.rank})
        if len(others) > 1:  # a collective's group: any of them may have gone
            lost += f" (the connection of one of ranks {', '.join(map(str, others))})"
        return PeerFailure(f"gpipe_fast: {lost}")

    def _blame(self, dead: tuple[int, str], seen: str) -> PeerFailure:
        """Reports `dead` (a rank, how it ended or that it did not answer) as the step's
        failure, with what this rank `seen`; the failure every rank reads, as a PeerFailure
        (an earlier report wins)."""
        self.report(f"{dead[1]}; {seen}", rank=dead[0])
        return PeerFailure(f"gpipe_fast: the step failed on {self.failure() or self.local}")


# Guards whose failure other ranks may still have to read when the process exits.
_lingering: weakref.WeakSet[Guard] = weakref.WeakSet()


@atexit.register
def _linger_at_exit() -> None:
    guards = list(_lingering)
    for guard in guards:  # the origin first: a rank may be one pipe's origin, another's reader
        guard.linger()
    for guard in guards:
        guard.hold()

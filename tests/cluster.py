"""Persistent worker processes joined by gloo, reused across test cases (a spawn costs seconds).

Each worker runs `dist_cases.<name>(rank, world, **kwargs)` (`<module>.<name>` names another
module of tests/) on request and replies with plain Python data (or the error's type, message
and traceback). Every wait on a reply is bounded, so a hang fails the test instead of the run;
a worker that dies is seen within a second, named with its exit code (a signal by name) and
the end of its log (fatal signals' tracebacks, C++ aborts' messages), and the next case starts
a fresh set of workers, so that one death fails one test rather than the module's rest.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

REPLY_TIMEOUT_S = 120.0


@dataclass
class Reply:
    rank: int
    value: Any = None
    error_type: str | None = None  # the exception's class name when the case raised
    error: str = ""
    traceback: str = ""
    seconds: float = 0.0  # how long the case ran on that rank

    @property
    def failed(self) -> bool:
        return self.error_type is not None


def _tail(path: str, size: int = 4000) -> str:
    """The last `size` characters of a worker's log."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError as error:
        return f"(no log: {error})"
    return text[-size:] if text else "(empty)"


def _serve(
    rank: int, world: int, log_path: str, store_path: str, requests: Any, replies: Any
) -> None:
    # The worker's stderr is its log, which a failed run quotes: what a dying worker says (a
    # fatal signal's traceback of every thread, a C++ abort's message, the traceback that
    # multiprocessing prints of an uncaught error) would otherwise land in whatever test
    # pytest was capturing when the fork server started.
    log = open(log_path, "a", buffering=1)  # open for the worker's life
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log, all_threads=True)
    # Ctrl-C raises KeyboardInterrupt, as in a user's process, even where the suite was started
    # as a shell's background job (`pytest &` ignores SIGINT, and so would its workers).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    # Every multi-process test runs with poisoned rings: a byte a ring handed out, and a
    # received message once it goes, read as NaN (gpipe_fast.distributed.shm_links).
    os.environ.setdefault("GPIPE_FAST_DEBUG_POISON", "1")
    import importlib

    import dist_cases  # noqa: F401  (loaded up front: most cases live there)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    while True:
        name, kwargs = requests.get()
        if name == "stop":
            break
        if name == "reset":  # a fresh process group: after a failed step (docs/processes.md)
            dist.destroy_process_group()
            dist.init_process_group(
                "gloo", init_method=f"file://{kwargs['path']}", rank=rank, world_size=world
            )
            replies.put(Reply(rank))
            continue
        start = time.monotonic()
        try:
            module, _, function = name.rpartition(".")
            case = getattr(importlib.import_module(module or "dist_cases"), function)
            value = case(rank, world, **kwargs)
            replies.put(Reply(rank, value, seconds=time.monotonic() - start))
        except BaseException as error:
            replies.put(
                Reply(
                    rank,
                    error_type=type(error).__name__,
                    error=str(error),
                    traceback=traceback.format_exc(),
                    seconds=time.monotonic() - start,
                )
            )
    dist.destroy_process_group()


# What the fork server imports before it forks any worker (a module it cannot import is
# skipped: the worker imports it itself). gpipe_fast imports FSDP only where a stage is
# sharded, which many cases do: the server imports it once for them.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "gpipe_fast", "dist_cases"]


class Cluster:
    """`world` workers; run(name, **kwargs) runs a case on all and returns their replies."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.folder = tempfile.mkdtemp(prefix="gpipe-cluster-")
        self.resets = 0
        self.starts = 0  # sets of workers started: a death or a hang replaces the set
        self._start()

    def _start(self) -> None:
        # Forked from a server that imported torch, gpipe_fast and the cases once for the
        # session (its imports only: no thread, no process group), rather than spawned: a
        # spawned worker spent seconds on those imports, per worker and per test module.
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        self.starts += 1
        self.logs = [os.path.join(self.folder, f"start{self.starts}-rank{r}.log")
                     for r in range(self.world)]  # fmt: skip
        self.requests = [context.Queue() for _ in range(self.world)]
        self.replies = context.Queue()
        store = os.path.join(self.folder, f"start{self.starts}-store0")
        tests = os.path.dirname(os.path.abspath(__file__))
        previous = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = tests + (os.pathsep + previous if previous else "")
        try:
            self.processes = [
                context.Process(
                    target=_serve,
                    args=(r, self.world, self.logs[r], store, self.requests[r], self.replies),
                    daemon=True,
                )
                for r in range(self.world)
            ]
            for process in self.processes:
                process.start()
        finally:
            if previous is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = previous
        self.broken = False

    def _restart(self) -> None:
        """A fresh set of workers in place of one a death or a hang broke."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        self._start()

    def run(self, name: str, timeout_s: float = REPLY_TIMEOUT_S, **kwargs: Any) -> list[Reply]:
        """Runs the case on every worker; replies in rank order. Raises AssertionError when
        a worker dies or does not reply within `timeout_s`; the next run starts fresh workers."""
        if self.broken or not all(p.is_alive() for p in self.processes):
            self._restart()
        for q in self.requests:
            q.put((name, kwargs))
        return self._collect(name, timeout_s)

    def _collect(self, name: str, timeout_s: float, expect: set[int] | None = None) -> list[Reply]:
        expect = set(range(self.world)) if expect is None else expect
        replies: dict[int, Reply] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(expect):
            try:
                reply = self.replies.get(timeout=1.0)
                replies[reply.rank] = reply
                continue
            except queue.Empty:
                pass
            dead = [r for r in expect - set(replies) if not self.processes[r].is_alive()]
            if dead:
                self.broken = True
                raise AssertionError(
                    f"{name}: worker(s) {dead} died without replying\n" + self._deaths(dead)
                )
            if time.monotonic() >= deadline:
                self.broken = True
                late = sorted(expect - set(replies))
                raise AssertionError(
                    f"{name}: no reply from rank(s) {late} within {timeout_s} s (a hang)\n"
                    + self._deaths(late)
                )
        return [replies[r] for r in sorted(replies)]

    def _deaths(self, ranks: list[int]) -> str:
        """Each rank's exit code (a signal by name) and the end of its log."""
        parts = []
        for r in ranks:
            code = self.processes[r].exitcode
            if code is None:
                how = "still running"
            elif code < 0:
                how = f"killed by {signal.Signals(-code).name}"
            else:
                how = f"exit code {code}"
            parts.append(f"--- rank {r}: {how}; the end of its log ---\n{_tail(self.logs[r])}")
        return "\n".join(parts)

    def collect_survivors(self, name: str, survivors: set[int], timeout_s: float) -> list[Reply]:
        """The replies of `survivors` after others were killed on purpose."""
        return self._collect(name, timeout_s, survivors)

    def reset(self) -> None:
        """A fresh process group on every worker (after a failed step)."""
        self.resets += 1
        path = os.path.join(self.folder, f"store{self.resets}")
        for q in self.requests:
            q.put(("reset", {"path": path}))
        replies = self._collect("reset", 60.0)
        assert all(not r.failed for r in replies), replies

    def close(self) -> None:
        for q, process in zip(self.requests, self.processes, strict=True):
            if process.is_alive():
                q.put(("stop", {}))
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def raise_reply(reply: Reply) -> None:
    """Fails the test with a worker's own traceback."""
    raise AssertionError(
        f"rank {reply.rank} raised {reply.error_type}: {reply.error}\n{reply.traceback}"
    )


def values(replies: list[Reply]) -> list[Any]:
    for reply in replies:
        if reply.failed:
            raise_reply(reply)
    return [reply.value for reply in replies]


__all__ = ["Cluster", "Reply", "raise_reply", "traceback", "values"]

"""Two spawned benchmark workers (or `world` of them) joined by gloo over 127.0.0.1, asked in
lockstep and always stopped: a worker that dies fails the run within a second, one whose
parent is gone leaves."""

from __future__ import annotations

import os
import queue
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

# A worker's reply: (rank, what it answers, its value, an error message or None).
Reply = tuple[int, str, Any, str | None]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_gloo(
    rank: int, port: int, timeout_s: float, pin_threads: bool = True, world: int = 2
) -> None:
    """Joins this worker to the pair's gloo group, on loopback, with one intra-op thread
    (`pin_threads`) or the threads as the environment leaves them (as users run)."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if pin_threads:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


@contextmanager
def in_gloo_pair(
    rank: int, port: int, timeout_s: float, replies: Any, pin_threads: bool = True, world: int = 2
) -> Iterator[None]:
    """A worker's life in the pair: joins its gloo group (see join_gloo), and an error in
    the body is replied to the parent (which stops the run within a second) instead of
    raised; the group is left whatever happens."""
    try:
        join_gloo(rank, port, timeout_s, pin_threads, world)
        yield
    except BaseException as error:
        replies.put((rank, "error", None, f"{type(error).__name__}: {error}"))
    finally:
        leave_gloo()


def requests_of(requests: Any, parent: int) -> Any:
    """The requests sent to this worker, until "stop" or until its parent process is gone."""
    while True:
        try:
            request = requests.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # the main process is gone: leave
                return
            continue
        if request == "stop":
            return
        yield request


def leave_gloo() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class WorkerPair:
    """Ranks 0 and 1 (or 0 to `world` - 1) running `target(rank, port, requests, replies,
    parent)`; each answers "ready" once joined, then one reply per request."""

    def __init__(self, target: Callable[..., None], timeout_s: float, world: int = 2) -> None:
        context = mp.get_context("spawn")
        port = free_port()
        self.timeout_s = timeout_s
        self.replies = context.Queue()
        self.requests = [context.Queue() for _ in range(world)]
        self.processes = [
            context.Process(
                target=target,
                args=(rank, port, self.requests[rank], self.replies, os.getpid()),
                daemon=True,
            )
            for rank in range(world)
        ]
        for process in self.processes:
            process.start()
        self.ready = self.ask(None, "ready")  # what each rank said when it was ready

    def ask(self, request: str | None, expected: str) -> list[Any]:
        """Sends `request` to both ranks (None: nothing) and returns their values by rank."""
        if request is not None:
            for q in self.requests:
                q.put(request)
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(answers) < len(self.processes):
            try:
                rank, what, value, error = self.replies.get(timeout=1.0)
            except queue.Empty:
                dead = [p.pid for p in self.processes if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"workers did not answer {expected!r} (dead: {dead})"
                    ) from None
                continue
            if error is not None:
                raise RuntimeError(f"worker {rank}: {error}")
            assert what == expected, (what, expected)
            answers[rank] = value
        return [answers[rank] for rank in range(len(self.processes))]

    def stop(self) -> None:
        for q in self.requests:
            try:
                q.put("stop")
            except (OSError, ValueError):
                pass
        for process in self.processes:
            process.join(timeout=10)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()

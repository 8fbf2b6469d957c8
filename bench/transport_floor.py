"""The floor of the transport between two processes of one host: a ping-pong per message size.

Issue 21 asks whether gloo's own per-message latency is what bounds small tasks across
processes. Two spawned processes (gloo on 127.0.0.1, GLOO_SOCKET_IFNAME=lo, one intra-op
thread each) bounce a float32 tensor back and forth; rank 0 times each round trip. Contenders,
interleaved round by round (order rotated) in one run:

- gloo: isend + wait, irecv + wait, nothing else (the floor of gloo);
- gloo+guard: the same, each wait through gpipe_fast's Guard.wait as the cross-process
  transport waits (a helper thread waits, the caller polls the store for failures);
- shm: gpipe_fast._C's shared-memory channel (ShmSender / ShmReceiver), one ring per
  direction; the echo sends back the message it received, as a receiver's tensor would be.

Sizes: 8 KiB (an inline boundary tensor) and 1 MiB (larger than most small tasks' tensors).

    python bench/transport_floor.py [--rounds 10] [--trips 200] [--sizes 8192,1048576]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

# The checkout's gpipe_fast (built in place), in the spawned workers too, ahead of an install.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_pair import WorkerPair, in_gloo_pair, requests_of

from gpipe_fast.distributed import shm_links

CONTENDERS = ("gloo", "gloo+guard", "shm")
REPLY_TIMEOUT_S = 300.0
RING_BYTES = 1 << 21  # 2 MiB: a 1 MiB message goes in whole
SPIN_US = shm_links.SPIN_US  # the pipe's own: busy 20 us, then yielding, then a futex sleep


def _gloo_trip(rank: int, x: torch.Tensor, y: torch.Tensor, wait: Callable[[Any], None]) -> None:
    import torch.distributed as dist

    peer = 1 - rank
    if rank == 0:
        wait(dist.isend(x, dst=peer))
        wait(dist.irecv(y, src=peer))
    else:
        wait(dist.irecv(y, src=peer))
        wait(dist.isend(y, dst=peer))


def _shm_trip(rank: int, x: torch.Tensor, sender: Any, receiver: Any, tag: int) -> None:
    if rank == 0:
        sender.send(tag, [(x.data_ptr(), x.numel() * 4)])
        receiver.receive(tag, REPLY_TIMEOUT_S)
    else:
        message = receiver.receive(tag, REPLY_TIMEOUT_S)
        echo = torch.frombuffer(message, dtype=torch.float32)
        sender.send(tag, [(echo.data_ptr(), echo.numel() * 4)])


def _shm_pair(rank: int, prefix: str) -> tuple[Any, Any]:
    """This rank's receiver (from the peer) and sender (to it), connected."""
    from gpipe_fast import _C

    receiver = _C.ShmReceiver(f"{prefix}-to{rank}", RING_BYTES, SPIN_US)
    sender = _C.ShmSender(f"{prefix}-to{1 - rank}", 60.0, SPIN_US)
    receiver.wait_attached(60.0)
    return sender, receiver


def worker(rank: int, port: int, requests: Any, replies: Any, parent: int) -> None:
    """Answers (contender, nbytes, trips) with rank 0's round-trip times in seconds."""
    import torch.distributed as dist

    from gpipe_fast.distributed.guard import Guard

    with in_gloo_pair(rank, port, REPLY_TIMEOUT_S, replies):
        store = dist.distributed_c10d._get_default_store()
        guard = Guard(store, f"floor-{port}", rank, REPLY_TIMEOUT_S, peers=1)
        sender, receiver = _shm_pair(rank, f"/gpf-floor-{parent}-{port}")
        replies.put((rank, "ready", None, None))
        tag = 0
        for contender, nbytes, trips in requests_of(requests, parent):
            x = torch.randn(nbytes // 4)
            y = torch.empty_like(x)
            dist.barrier()
            times = []
            for _ in range(trips):
                tag += 1
                start = time.perf_counter()
                if contender == "gloo":
                    _gloo_trip(rank, x, y, lambda request: request.wait())
                elif contender == "gloo+guard":
                    _gloo_trip(rank, x, y, lambda request: guard.wait(request, "a ping"))
                else:
                    _shm_trip(rank, x, sender, receiver, tag)
                times.append(time.perf_counter() - start)
            replies.put((rank, "trips", times, None))
        sender.close("the benchmark ended")
        receiver.close("the benchmark ended")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--trips", type=int, default=200, help="round trips per contender, round")
    parser.add_argument("--sizes", default="8192,1048576", help="message sizes in bytes")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    contenders = args.contenders.split(",")
    pair = WorkerPair(worker, REPLY_TIMEOUT_S)
    samples: dict[tuple[str, int], list[float]] = {(c, n): [] for c in contenders for n in sizes}
    try:
        for round_ in range(args.rounds + 1):  # round 0 warms up and is dropped
            order = contenders[round_ % len(contenders) :] + contenders[: round_ % len(contenders)]
            for nbytes in sizes:
                for contender in order:
                    times = pair.ask((contender, nbytes, args.trips), "trips")[0]
                    if round_ > 0:
                        samples[(contender, nbytes)] += times
    finally:
        pair.stop()
    print(f"ping-pong between 2 processes, {args.rounds} rounds x {args.trips} round trips; "
          "median round trip in us (p10-p90)")  # fmt: skip
    print(f"{'size':>10}" + "".join(f"{c:>24}" for c in contenders))
    for nbytes in sizes:
        cells = []
        for contender in contenders:
            values = sorted(samples[(contender, nbytes)])
            p10, p90 = values[len(values) // 10], values[len(values) * 9 // 10]
            middle = statistics.median(values)
            cells.append(f"{middle * 1e6:>9.1f} ({p10 * 1e6:.0f}-{p90 * 1e6:.0f})")
        print(f"{nbytes:>10}" + "".join(f"{c:>24}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cases of test_shm_channel.py, run on both ranks of a Cluster: shared-memory channels."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe_fast import _C

LANES = (0, 1)  # activations, gradients: one receiving thread each
SPIN_US = 5.0
CONNECT_TIMEOUT_S = 30.0


@dataclass
class Link:
    """This rank's ends of the rings to and from the other rank, one per lane."""

    senders: list[_C.ShmSender]
    receivers: list[_C.ShmReceiver]


_links: dict[str, Link] = {}


def ring_name(prefix: str, sender: int, receiver: int, lane: int) -> str:
    return f"{prefix}-s{sender}-r{receiver}-l{lane}"


def leftovers(prefix: str) -> list[str]:
    """The files of `prefix` still in /dev/shm."""
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix[1:]))


def shm_connect(rank: int, world: int, *, prefix: str, ring_bytes: int) -> list[str]:
    """Creates this rank's receiving rings, attaches to the peer's, waits for the peer to
    attach to ours; returns what is left in /dev/shm then (nothing)."""
    peer = 1 - rank
    receivers = [_C.ShmReceiver(ring_name(prefix, peer, rank, lane), ring_bytes, SPIN_US)
                 for lane in LANES]  # fmt: skip
    senders = [_C.ShmSender(ring_name(prefix, rank, peer, lane), CONNECT_TIMEOUT_S, SPIN_US)
               for lane in LANES]  # fmt: skip
    for receiver in receivers:
        receiver.wait_attached(CONNECT_TIMEOUT_S)
    _links[prefix] = Link(senders, receivers)
    dist.barrier()  # both have attached everywhere before either looks
    return leftovers(prefix)


def shm_disconnect(rank: int, world: int, *, prefix: str) -> list[str]:
    link = _links.pop(prefix)
    for end in [*link.senders, *link.receivers]:
        end.close("the test is over")
    del link
    dist.barrier()
    return leftovers(prefix)


def _send(sender: _C.ShmSender, tag: int, tensors: list[Tensor]) -> bool:
    return sender.send(tag, [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors])


def _unpack(
    message: _C.ShmMessage, specs: list[tuple[torch.dtype, tuple[int, ...]]]
) -> list[Tensor]:
    """The tensors of a message, viewed in place at the channel's aligned offsets."""
    # torch.frombuffer refuses an empty buffer: a message of empty tensors has no bytes.
    room = torch.frombuffer(message, dtype=torch.uint8) if len(message) else torch.empty(0)
    out, at = [], 0
    align = _C.SHM_PART_ALIGN
    for dtype, shape in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        out.append(room[at : at + nbytes].view(dtype).view(shape))
        at += -(-nbytes // align) * align
    return out


# Messages of the round trip: several tensors of several dtypes each; the last is 4 MiB, far
# more than the test's ring.
MESSAGES: list[list[tuple[torch.dtype, tuple[int, ...]]]] = [
    [(torch.float32, (2048,))],
    [(torch.float64, (3, 5)), (torch.int64, (7,)), (torch.bool, (13,))],
    [(torch.bfloat16, (33, 3)), (torch.int8, (1,)), (torch.complex64, (4, 4))],
    [(torch.float16, (0,))],
    [(torch.float32, (1024, 1024))],
]


def _tensors(index: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(index)
    out = []
    for dtype, shape in MESSAGES[index]:
        values = torch.randn(shape, generator=generator, dtype=torch.float64) * 100
        out.append(values.to(dtype) if not dtype.is_complex else values.to(dtype) * 1j)
    return out


def shm_round_trip(rank: int, world: int, *, prefix: str) -> list[bool]:
    """Rank 0 sends each message on lane 0; rank 1 echoes it from the received bytes on lane 1;
    rank 0 compares what came back with what it sent."""
    link = _links[prefix]
    same = []
    for index, specs in enumerate(MESSAGES):
        if rank == 0:
            sent = _tensors(index)
            _send(link.senders[0], index, sent)
            echo = _unpack(link.receivers[1].receive(index, 30.0), specs)
            same.append(all(torch.equal(a, b) for a, b in zip(sent, echo, strict=True)))
        else:
            received = _unpack(link.receivers[0].receive(index, 30.0), specs)
            same.append(all(torch.equal(a, b) for a, b in zip(_tensors(index), received,
                                                              strict=True)))  # fmt: skip
            _send(link.senders[1], index, received)
    link.senders[0].flush(30.0)
    link.senders[1].flush(30.0)
    return same


def shm_out_of_order(rank: int, world: int, *, prefix: str) -> list[int]:
    """Rank 0 sends tags 100..107 in order; rank 1 asks for them in another order. Returns, on
    rank 1, the messages kept aside after each receive."""
    link = _links[prefix]
    tags = list(range(100, 108))
    if rank == 0:
        for tag in tags:
            _send(link.senders[0], tag, [torch.full((4,), tag, dtype=torch.int64)])
        link.senders[0].flush(30.0)
        return []
    aside = []
    for tag in (107, 100, 103, 101, 102, 106, 104, 105):
        (value,) = _unpack(link.receivers[0].receive(tag, 30.0), [(torch.int64, (4,))])
        assert torch.equal(value, torch.full((4,), tag, dtype=torch.int64)), (tag, value)
        aside.append(link.receivers[0].set_aside)
    return aside


def shm_full_ring(rank: int, world: int, *, prefix: str, ring_bytes: int) -> dict[str, Any]:
    """Rank 0 sends 16 rings' worth while rank 1 reads nothing (it waits at a barrier): the
    sends return at once, queued; then rank 1 reads them all and rank 0's flush completes."""
    link = _links[prefix]
    count, chunk = 32, torch.arange(ring_bytes // 2 // 8, dtype=torch.int64)
    if rank == 0:
        start = time.monotonic()
        direct = [_send(link.senders[0], tag, [chunk + tag]) for tag in range(count)]
        elapsed = time.monotonic() - start
        queued = link.senders[0].queued_bytes
        dist.barrier()
        link.senders[0].flush(30.0)
        return {"seconds": elapsed, "direct": sum(direct), "queued": queued,
                "after_flush": link.senders[0].queued_bytes}  # fmt: skip
    dist.barrier()
    for tag in range(count):
        (value,) = _unpack(
            link.receivers[0].receive(tag, 30.0), [(torch.int64, tuple(chunk.shape))]
        )
        assert torch.equal(value, chunk + tag), tag
    return {}


def shm_threads_and_lanes(rank: int, world: int, *, prefix: str) -> int:
    """Rank 0: two threads send on lane 0 at once and one on lane 1; rank 1: one receiving
    thread per lane, each asking for the tags in its own order. Returns messages checked."""
    link = _links[prefix]
    per_thread = 200
    plan = {0: [0, 1000], 1: [2000]}  # lane -> the first tag of each sending thread
    if rank == 0:

        def produce(lane: int, first: int) -> None:
            for i in range(per_thread):
                _send(link.senders[lane], first + i, [torch.full((64,), float(first + i))])

        threads = [threading.Thread(target=produce, args=(lane, first))
                   for lane, firsts in plan.items() for first in firsts]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for sender in link.senders:
            sender.flush(30.0)
        return 0
    checked = [0, 0]

    def consume(lane: int) -> None:
        for tag in sorted(first + i for first in plan[lane] for i in range(per_thread)):
            (value,) = _unpack(link.receivers[lane].receive(tag, 30.0), [(torch.float32, (64,))])
            assert torch.equal(value, torch.full((64,), float(tag))), tag
            checked[lane] += 1

    threads = [threading.Thread(target=consume, args=(lane,)) for lane in LANES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60.0)
    return sum(checked)


def shm_timeout(rank: int, world: int, *, prefix: str, wait_s: float) -> dict[str, Any]:
    """Rank 1 asks for a message that never comes."""
    if rank == 0:
        return {}
    start = time.monotonic()
    try:
        _links[prefix].receivers[0].receive(999, wait_s)
    except TimeoutError as error:
        return {"seconds": time.monotonic() - start, "error": str(error)}
    return {"seconds": time.monotonic() - start, "error": None}


def shm_close(rank: int, world: int, *, prefix: str) -> dict[str, Any]:
    """Rank 0 poisons its lane-0 sender while rank 1 waits on it; rank 1 then poisons its
    lane-1 receiver, which rank 0's sends to it meet."""
    link = _links[prefix]
    if rank == 0:
        time.sleep(0.2)
        link.senders[0].close("rank 0 failed", failed=True)
        start = time.monotonic()
        while time.monotonic() - start < 30.0:
            try:
                _send(link.senders[1], 1, [torch.zeros(16)])
            except ConnectionError as error:
                return {"error": str(error)}
            time.sleep(0.01)
        return {"error": None}
    start = time.monotonic()
    try:
        link.receivers[0].receive(1, 30.0)
        error = None
    except ConnectionError as closed:
        error = str(closed)
    seconds = time.monotonic() - start
    link.receivers[1].close("rank 1 failed", failed=True)
    return {"seconds": seconds, "error": error}


def shm_die(rank: int, world: int, *, prefix: str) -> dict[str, Any]:
    """Rank 1 dies (no close, no cleanup) while rank 0 waits for its message."""
    link = _links[prefix]
    if rank == 1:
        time.sleep(0.3)
        os._exit(3)
    start = time.monotonic()
    try:
        link.receivers[0].receive(1, 60.0)
        error = None
    except ConnectionError as closed:
        error = str(closed)
    return {"seconds": time.monotonic() - start, "error": error}

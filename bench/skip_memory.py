"""Peak memory and boundary traffic of a U-Net in a pipe: skips against tuples carried through.

Before gpipe_fast.skip, a model whose decoder needs the encoder's features had to carry them
through every cell in between, inside a tuple: each of those cells holds them as its
stashed input and re-sends them at its boundary. This runs the demo's conv U-Net (a skip
at every level) through the same pipe both ways, with the same weights and batches:

- ``skips``: the skippable U-Net (gpipe_fast/demo/unet.py), each skip handed straight from
  its stashing cell to its popping cell;
- ``tuples``: the same layers rewritten to take and return (x, *features), the pre-skip way.

Per train_step, the two pipes' steps interleaved, it measures the peak of each process's
heap (glibc mallinfo2: arena plus mmap'ed bytes, sampled every 0.5 ms by a thread, minus
the bytes in use before the step), first in one process (cells hand tensors over without a
copy, so the carried features cost no memory there) and then with one cell per process
(gloo, each process receives its own copy of what crosses into it); in one process it also
counts the bytes handed across cell boundaries (the activation tuples and the skips). Both
ways must give the same loss (checked). Medians over the steps.

    python bench/skip_memory.py [--cells 4] [--chunks 4] [--batch 64] [--steps 8]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import markdown_table

import gpipe_fast as gf
from gpipe_fast.demo.unet import Decode, Encode, batch, unet
from gpipe_fast.transport.local import LocalTransport


class _MallInfo2(ctypes.Structure):
    _FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS.split()]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_bytes() -> int:
    """Bytes the process has allocated with malloc now (small blocks and mmap'ed ones)."""
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def peak_during(run: Callable[[], Any], every_s: float = 5e-4) -> tuple[Any, int]:
    """run()'s result and the peak of heap_bytes() while it ran, above the bytes before."""
    base = heap_bytes()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], heap_bytes())
            time.sleep(every_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = run()
    finally:
        done.set()
        sampler.join()
    return result, max(peak[0], heap_bytes()) - base


class _Carry(nn.Module):
    """A U-Net layer rewritten for tuples: takes (x, *features) and returns the next tuple."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, value: Any) -> Any:
        x, *features = value if isinstance(value, tuple) else (value,)
        layer = self.layer
        if isinstance(layer, Encode):
            found = layer.block(x)
            return (nn.functional.max_pool2d(found, 2), *features, found)
        if isinstance(layer, Decode):
            skip = features.pop()
            y = layer.block(torch.cat([layer.up(x), skip], dim=1))
            return (y, *features) if features else y
        y = layer(x)
        return (y, *features) if features else y


def carried(model: nn.Sequential) -> nn.Sequential:
    """The skippable U-Net's layers (shared), each wrapped to carry the features in tuples."""
    return nn.Sequential(*(_Carry(layer) for layer in model))


class _Counting(LocalTransport):
    """The in-process transport, counting the bytes each send and skip hands on."""

    moved = 0

    def send(self, flow: Any, stage: int, microbatch: int, payload: Any) -> None:
        tensors = [payload] if isinstance(payload, torch.Tensor) else payload
        _Counting.moved += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        super().send(flow, stage, microbatch, payload)

    def send_skip(self, flow: Any, stage: int, receiver: int, microbatch: int, key: Any,
                  tensor: torch.Tensor | None) -> None:  # fmt: skip
        if tensor is not None:
            _Counting.moved += tensor.numel() * tensor.element_size()
        super().send_skip(flow, stage, receiver, microbatch, key, tensor)


def _pipes(args: argparse.Namespace, **kwargs: Any) -> tuple[dict[str, gf.GPipe], list[int]]:
    """The two pipes (skips, tuples) over the same weights."""
    torch.manual_seed(0)
    skippable = unet()
    tuples = carried(copy.deepcopy(skippable))
    balance = gf.balance_by_params(args.cells, skippable)
    pipes = {
        name: gf.GPipe(model, balance, chunks=args.chunks, checkpoint=args.checkpoint, **kwargs)
        for name, model in (("skips", skippable), ("tuples", tuples))
    }
    return pipes, balance


def measure(args: argparse.Namespace, **kwargs: Any) -> dict[str, dict[str, list[int]]]:
    """Per pipe, this process's heap peaks and the bytes handed between cells, per step."""
    pipes, _ = _pipes(args, **kwargs)
    got: dict[str, dict[str, list[int]]] = {name: {"peak": [], "moved": []} for name in pipes}
    try:
        for step in range(args.steps + 1):  # the first step of each warms up
            noisy, clean = batch(step, args.batch)
            losses = {}
            for name, pipe in pipes.items():  # interleaved, step by step
                pipe.zero_grad(set_to_none=True)
                _Counting.moved = 0
                loss, peak = peak_during(
                    lambda p=pipe, x=noisy, y=clean: p.train_step(x, y, nn.functional.mse_loss)
                )
                losses[name] = loss.item()
                if step > 0:
                    got[name]["peak"].append(peak)
                    got[name]["moved"].append(_Counting.moved)
            assert abs(losses["skips"] - losses["tuples"]) <= 1e-5 * abs(losses["skips"]), losses
    finally:
        for pipe in pipes.values():
            pipe.close()
    return got


def _rank(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.cells)
    try:
        results.put((rank, measure(args, pp_group=dist.group.WORLD)))
    finally:
        dist.destroy_process_group()


def per_process(args: argparse.Namespace) -> list[dict[str, dict[str, list[int]]]]:
    """measure() on each of args.cells processes, one cell each: every rank's results."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(r, args, port, results))
                 for r in range(args.cells)]  # fmt: skip
    for process in processes:
        process.start()
    got = dict(results.get(timeout=600) for _ in processes)
    for process in processes:
        process.join()
    return [got[rank] for rank in range(args.cells)]


def _mib(values: list[int]) -> str:
    return f"{statistics.median(values) / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--checkpoint", default="never")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    # Every step's in-process transport counts what it hands on (make_transport looks the
    # class up in its module at each step).
    import gpipe_fast.transport.processes.registry as registry

    registry.LocalTransport = _Counting  # type: ignore[misc]

    _, balance = _pipes(args, devices=["cpu"] * args.cells)
    print(f"U-Net {len(balance)} cells {balance}, batch {args.batch}, M={args.chunks}, "
          f"checkpoint {args.checkpoint!r}, {args.steps} steps each way, interleaved")  # fmt: skip
    one = measure(args, devices=["cpu"] * args.cells)
    print("\nOne process, a worker per cell:")
    print(markdown_table(
        ["carried as", "peak MiB (median)", "MiB handed between cells per step"],
        [[name, _mib(got["peak"]), _mib(got["moved"])] for name, got in one.items()],
    ))  # fmt: skip
    ranks = per_process(args)
    print(f"\n{args.cells} processes (gloo), a cell each: peak MiB per rank (median)")
    print(markdown_table(
        ["carried as", *(f"rank {r}" for r in range(args.cells)), "sum"],
        [[name, *(_mib(r[name]["peak"]) for r in ranks),
          f"{sum(statistics.median(r[name]['peak']) for r in ranks) / 2**20:.1f}"]
         for name in ("skips", "tuples")],
    ))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

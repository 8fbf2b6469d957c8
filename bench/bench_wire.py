"""What a boundary message costs to build and to read, per payload: python bench/bench_wire.py.

Build: wire.gather (a shared-memory message's parts) and wire.encode (gloo's message, its
tensors inline). Read: wire.message of the received bytes. For a lone tensor, a tuple of
tensors (the header alone describes them) and pytrees (a dict with a bool mask and an int,
a tuple holding None and an int: their structure and other leaves pickled). Each figure is
the best of 50 repeats of 200 (short: a loaded machine leaves some whole), in microseconds
per message."""

from __future__ import annotations

import timeit
from collections.abc import Callable
from typing import Any

import torch

from gpipe_fast.transport import wire

CPU = torch.device("cpu")


def _payloads() -> dict[str, Any]:
    h = torch.randn(8, 64)
    return {
        "tensor": h,
        "tuple of 3 tensors": (h, torch.randn(8, 64), torch.arange(8)),
        "dict {h, mask, n}": {"h": h, "mask": h > 0, "n": 3},
        "tuple (h, None, cos, 3)": (h, None, torch.randn(64), 3),
    }


def _best_us(run: Callable[[], Any], number: int = 200, repeat: int = 50) -> float:
    return min(timeit.repeat(run, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    print(f"{'payload':<26}{'gather':>10}{'encode':>10}{'read':>10}  (us per message)")
    for name, payload in _payloads().items():
        try:
            received = wire.encode(payload, CPU, wire.INLINE_BYTES).numpy()
        except Exception as error:  # a wire that does not carry this payload
            print(f"{name:<26}  not carried: {type(error).__name__}")
            continue
        gather = _best_us(lambda p=payload: wire.gather(p))  # type: ignore[misc]
        encode = _best_us(lambda p=payload: wire.encode(p, CPU, wire.INLINE_BYTES))  # type: ignore[misc]
        read = _best_us(lambda r=received: wire.message(r))  # type: ignore[misc]
        print(f"{name:<26}{gather:>10.2f}{encode:>10.2f}{read:>10.2f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

"""Shared test helpers: reference runs against the unpartitioned module, layers of known cost."""

from __future__ import annotations

import copy
import faulthandler
import gc
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whole: a shard of a sharded stage (a DTensor, dp_shard) gathered."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def mlp(layers: int, width: int = 6, *, dropout: float = 0.0) -> nn.Sequential:
    """Linear+Tanh layers (plus Dropout when asked), in float64 so tolerances can be tight."""
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.Tanh()]
        if dropout:
            modules.append(nn.Dropout(dropout))
    return nn.Sequential(*modules).double()


def reference_run(
    module: nn.Sequential, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Output, input gradient and parameter gradients of a copy of `module` on the whole batch."""
    ref = copy.deepcopy(module)
    x = x.detach().clone().requires_grad_()
    out = ref(x)
    (out * _weights(out)).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad, [p.grad.clone() for p in ref.parameters()]  # type: ignore[union-attr]


def pipe_run(
    pipe: nn.Module, module: nn.Sequential, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Same as reference_run through the pipe; gradients read from the original module."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = pipe(x)
    (out * _weights(out)).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad, [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]


def _weights(out: torch.Tensor) -> torch.Tensor:
    # A loss whose gradient differs per element, so a mixed-up micro-batch order would show.
    g = torch.Generator().manual_seed(7)
    return torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)


def assert_same_run(
    got: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]],
    want: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]],
) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)
    assert len(got[2]) == len(want[2])
    for i, (g, w) in enumerate(zip(got[2], want[2], strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"parameter {i}")


class _Sleep(torch.autograd.Function):
    """Identity that sleeps in forward and in backward: a layer of known time."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):  # type: ignore[no-untyped-def]
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        time.sleep(ctx.backward_s)
        return grad, None, None


class Sleepy(nn.Module):
    def __init__(self, forward_ms: float = 0.0, backward_ms: float = 0.0) -> None:
        super().__init__()
        self.forward_s = forward_ms / 1000
        self.backward_s = backward_ms / 1000

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.forward_s, self.backward_s)


def funnel() -> nn.Sequential:
    # Parameters: 272, 4352, 65792, 4112, 272: the middle layer outweighs all others together.
    return nn.Sequential(
        nn.Linear(16, 16),
        nn.Linear(16, 256),
        nn.Linear(256, 256),
        nn.Linear(256, 16),
        nn.Linear(16, 16),
    )


@contextmanager
def no_hang(seconds: float = 120.0) -> Iterator[None]:
    """Turns a hang into a failure: past `seconds`, dumps every thread's stack to stderr and
    exits the process (a deadlocked worker cannot be stopped from Python)."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def native_threads(prefix: str = "") -> int:
    """Threads of this process (from /proc/self/task) whose name starts with `prefix`; the
    executor's workers are named "gpipe-cell-<k>"."""
    # An earlier test's pipe that is garbage but not yet collected still has its workers;
    # collected later, in the middle of a test, it changed that test's count (seen after
    # test_exit_codes.py, on a loaded machine: 9 workers, then 3).
    gc.collect()
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                count += comm.read().startswith(prefix)
        except (FileNotFoundError, ProcessLookupError):  # ended while we looked (either)
            pass
    return count


class RaiseInBackward(torch.autograd.Function):
    """Identity in forward; raises `error` (an exception instance) in backward."""

    @staticmethod
    def forward(ctx, x, error):  # type: ignore[no-untyped-def]
        ctx.error = error
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        # Handed over, not kept: the error's traceback holds this graph, which holds ctx.
        error, ctx.error = ctx.error, None
        raise error


def device_sleep_cycles(ms: float) -> tuple[int, float]:
    """Cycles of ``torch.cuda._sleep`` that keep the current CUDA stream busy about `ms`
    (its clock rate varies by GPU and by power state, so it is measured), and the
    milliseconds they took when measured by CUDA events."""

    def measure(cycles: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    measure(1_000)  # warm-up: the first launch loads the kernel
    probe = 1_000_000
    cycles = max(probe, int(probe * ms / measure(probe)))
    return cycles, measure(cycles)

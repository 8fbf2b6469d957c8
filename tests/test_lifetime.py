"""Lifetime and threads: a deleted pipe joins its workers; pipes used from several threads at
once give the right gradients (one pipe's steps from two threads serialise)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

import pytest
import torch

import gpipe_fast as gf

from helpers import _weights, mlp, native_threads, no_hang, pipe_run, reference_run

WORKER = "gpipe-cell"


def _settles(count: Callable[[], int], want: int, seconds: float = 10.0) -> bool:
    """Whether count() comes down to `want` within `seconds` (a thread that was told to
    end may still be unwinding when join returns to another thread's view of /proc)."""
    deadline = time.monotonic() + seconds
    while count() > want and time.monotonic() < deadline:
        time.sleep(0.01)
    return count() <= want


def test_deleting_a_pipe_joins_its_workers() -> None:
    gc.collect()
    workers, threads = native_threads(WORKER), native_threads()
    module = mlp(3)
    pipe = gf.GPipe(module, [2, 2, 2], devices=["cpu"] * 3, chunks=4)
    with no_hang():
        pipe(torch.randn(8, 6, dtype=torch.float64)).sum().backward()
    assert native_threads(WORKER) == workers + 3
    del pipe
    gc.collect()  # a module is in reference cycles (its hooks refer to it)
    assert native_threads(WORKER) == workers
    assert _settles(native_threads, threads)


def test_a_pipe_deleted_with_a_pending_output_keeps_its_workers_until_the_output_goes() -> None:
    gc.collect()
    workers = native_threads(WORKER)
    module = mlp(2)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = gf.GPipe(module, [2, 2], devices=["cpu"] * 2, chunks=4)
    with no_hang():
        out = pipe(x)
        del pipe
        gc.collect()
        # The output's graph holds the step and its pipeline: the backward still runs.
        assert native_threads(WORKER) == workers + 2
        (out * _weights(out)).sum().backward()
    got = [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]
    for g, w in zip(got, reference_run(module, x)[2], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    del out
    gc.collect()
    assert native_threads(WORKER) == workers


def _in_threads(bodies: list[Callable[[], None]], timeout: float = 120.0) -> None:
    """Runs each body on its own thread at once; re-raises the first failure; a hang fails."""
    errors: list[BaseException] = []

    def guarded(body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(body,), daemon=True) for body in bodies]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_two_pipes_from_two_threads_at_once(make_pipe, checkpoint: str) -> None:
    modules = [mlp(3), mlp(3)]
    pipes = [
        make_pipe(m, [2, 2, 2], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint)
        for m in modules
    ]
    inputs = [torch.randn(8, 6, dtype=torch.float64) for _ in modules]
    results: list[list[object]] = [[], []]
    start = threading.Barrier(2, timeout=60)

    def train(i: int) -> Callable[[], None]:
        def body() -> None:
            start.wait()
            for _ in range(20):
                results[i].append(pipe_run(pipes[i], modules[i], inputs[i]))

        return body

    _in_threads([train(0), train(1)])
    for i, module in enumerate(modules):
        want = reference_run(module, inputs[i])
        assert len(results[i]) == 20
        for got in results[i]:
            torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)  # type: ignore[index]
            for g, w in zip(got[2], want[2], strict=True):  # type: ignore[index]
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_one_pipe_from_two_threads_at_once_serialises_its_runs(make_pipe) -> None:
    # Each thread runs whole steps (forward, then backward) on the same pipe at the same time;
    # the executor's runs serialise, so each output is right and the gradients accumulate.
    module = mlp(3)
    pipe = make_pipe(module, [2, 2, 2], devices=["cpu"] * 3, chunks=4)
    inputs = [torch.randn(8, 6, dtype=torch.float64) for _ in range(2)]
    wants = [reference_run(module, x) for x in inputs]
    rounds = 10
    outputs: list[list[torch.Tensor]] = [[], []]
    grads: list[list[torch.Tensor]] = []
    together = threading.Barrier(2, timeout=60)

    def train(i: int) -> Callable[[], None]:
        def body() -> None:
            for _ in range(rounds):
                together.wait()  # both steps of a round run at once
                x = inputs[i].clone().requires_grad_()
                out = pipe(x)
                (out * _weights(out)).sum().backward()
                outputs[i].append(out.detach())
                if together.wait() == 0:  # both done: one thread reads and zeroes
                    grads.append(torch.cat([p.grad.flatten() for p in module.parameters()]))
                    module.zero_grad(set_to_none=True)

        return body

    module.zero_grad(set_to_none=True)
    _in_threads([train(0), train(1)])
    want_grads = torch.cat([(a + b).flatten() for a, b in zip(*(w[2] for w in wants), strict=True)])
    assert len(grads) == rounds
    for got in grads:
        torch.testing.assert_close(got, want_grads, rtol=1e-10, atol=1e-12)
    for i in range(2):
        for out in outputs[i]:
            torch.testing.assert_close(out, wants[i][0], rtol=1e-10, atol=1e-12)

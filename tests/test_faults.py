"""Fault injection: an exception planted in any cell, micro-batch and pass (forward, recompute,
backward, the boundary copy) reaches the caller with its type and whereabouts, no worker is
left waiting, and the next step on the same pipe gives the unpartitioned module's gradients.
Ctrl-C (SIGINT) during a long step stops it the same way. A failed step's activations are
freed with its error (an out-of-memory error in recompute kept a GPU's whole batch)."""

from __future__ import annotations

import copy
import gc
import itertools
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.api.gpipe import pipeline_of
from gpipe_fast.arguments import CHECKPOINT_MODES

from helpers import (
    RaiseInBackward,
    assert_same_run,
    native_threads,
    no_hang,
    pipe_run,
    reference_run,
)

K, M, N, WIDTH = 3, 4, 8, 4  # 3 cells, 4 micro-batches of 2 samples
MICROBATCH = N // M
FIRST_MIDDLE_LAST = (0, 2, M - 1)


class PlantedError(Exception):
    """The planted exception: a type of its own, so the caller's type check means something."""


class _Faults:
    """Where to raise: (cell, micro-batch, pass) or None."""

    target: tuple[int, int, str] | None = None


class _Keep(nn.Module):
    """Applies `inner` to the features and passes the last column (the sample's index) through
    unchanged, so a layer anywhere in the pipe can tell which micro-batch it is running."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.inner(x[:, :-1]), x[:, -1:]], dim=1)


class _Plant(nn.Module):
    """Identity that raises when its cell, the micro-batch it sees and its pass are the target."""

    def __init__(self, cell: int, faults: _Faults) -> None:
        super().__init__()
        self.cell, self.faults = cell, faults

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target = self.faults.target
        if target is None or target[0] != self.cell:
            return x
        m = int(x[0, -1].item()) // MICROBATCH
        now = "recompute" if gf.is_recomputing() else "forward"
        if target[1:] == (m, now):
            raise PlantedError(f"planted in the {now} of micro-batch {m}")
        if target[1:] == (m, "backward"):
            return RaiseInBackward.apply(
                x, PlantedError(f"planted in the backward of micro-batch {m}")
            )
        return x


def _planted_model() -> tuple[nn.Sequential, _Faults]:
    faults = _Faults()
    layers: list[nn.Module] = []
    for cell in range(K):
        layers += [_Keep(nn.Linear(WIDTH, WIDTH)), _Plant(cell, faults), _Keep(nn.Tanh())]
    return nn.Sequential(*layers).double(), faults


def _tagged_input() -> torch.Tensor:
    features = torch.randn(N, WIDTH, dtype=torch.float64)
    return torch.cat([features, torch.arange(N, dtype=torch.float64)[:, None]], dim=1)


def _check_error(error: BaseException, cell: int, m: int, where: str, planted: str) -> None:
    assert type(error) is PlantedError
    message = str(error)
    assert planted in message, message
    head = message.split(planted)[0]  # the whereabouts come before the original text
    assert f"cell {cell}," in head and f"micro-batch {m}," in head and where in head, message


def _check_recovers(pipe: gf.GPipe, module: nn.Sequential, x: torch.Tensor, workers: int) -> None:
    assert pipeline_of(pipe).executor.live_events == 0
    # The caller zeroes the gradients (pipe_run does), and the next step is exact.
    with no_hang():
        assert_same_run(pipe_run(pipe, module, x), reference_run(module, x))
    assert native_threads("gpipe-cell") == workers  # no worker lost or added


@contextmanager
def _activations(module: nn.Module) -> Iterator[list[weakref.ref[torch.Tensor]]]:
    """Weak references to every layer output computed inside the block."""
    made: list[weakref.ref[torch.Tensor]] = []

    def keep(_layer: nn.Module, _args: Any, output: torch.Tensor) -> None:
        made.append(weakref.ref(output))

    hooks = [layer.register_forward_hook(keep) for layer in module.modules()]
    try:
        yield made
    finally:
        for hook in hooks:
            hook.remove()


def _check_freed(made: list[weakref.ref[torch.Tensor]]) -> None:
    """Once the caller has let go of the error, nothing of the failed step is alive."""
    gc.collect()
    alive = sum(ref() is not None for ref in made)
    assert made and alive == 0, f"{alive} of {len(made)} activations of the failed step alive"


def _cases() -> list[tuple[int, int, str, str]]:
    cases = []
    for cell, m, where, checkpoint in itertools.product(
        range(K), FIRST_MIDDLE_LAST, ("forward", "recompute", "backward"), CHECKPOINT_MODES
    ):
        recomputed = checkpoint == "always" or (checkpoint == "except_last" and m < M - 1)
        if where == "recompute" and not recomputed:
            continue  # that micro-batch is never recomputed in this mode
        cases.append((cell, m, where, checkpoint))
    return cases


@pytest.mark.parametrize(("cell", "m", "where", "checkpoint"), _cases())
def test_fault_in_a_cell_reaches_caller_and_pipe_recovers(
    make_pipe, cell: int, m: int, where: str, checkpoint: str
) -> None:
    module, faults = _planted_model()
    pipe = make_pipe(module, [3] * K, devices=["cpu"] * K, chunks=M, checkpoint=checkpoint)
    x = _tagged_input()
    pipe_run(pipe, module, x)  # the workers exist, and their Python state
    workers = native_threads("gpipe-cell")
    faults.target = (cell, m, where)
    out = None
    with _activations(module) as made, no_hang(), pytest.raises(PlantedError) as caught:
        out = pipe(x.clone().requires_grad_())
        assert where != "forward", "the forward fault did not fire"
        out.sum().backward()
    _check_error(caught.value, cell, m, f"{where} pass", f"planted in the {where}")
    del caught, out
    _check_freed(made)
    faults.target = None
    _check_recovers(pipe, module, x, workers)


def _schedule_order(phase: str, cell: int, checkpoint: str) -> list[int]:
    """The micro-batches of `cell`'s forward or backward tasks, in the order its worker runs
    them (the order in which it calls receive)."""
    if phase == "forward":
        schedule, kind = _C.gpipe_forward(K, M), _C.actions().index("forward")
    else:
        recompute = [
            checkpoint == "always" or (checkpoint == "except_last" and m < M - 1) for m in range(M)
        ]
        schedule, kind = _C.gpipe_backward(K, M, recompute), _C.actions().index("backward")
    tasks = [schedule.tasks[i] for i in schedule.order(cell)]
    return [task.microbatch for task in tasks if task.action == kind]


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("m", FIRST_MIDDLE_LAST)
@pytest.mark.parametrize("cell", range(K))
def test_fault_in_a_boundary_copy_is_named_as_such(
    make_pipe, monkeypatch: pytest.MonkeyPatch, cell: int, m: int, phase: str
) -> None:
    module, _ = _planted_model()
    pipe = make_pipe(module, [3] * K, devices=["cpu"] * K, chunks=M, checkpoint="except_last")
    x = _tagged_input()
    pipe_run(pipe, module, x)
    workers = native_threads("gpipe-cell")
    streams = pipeline_of(pipe).streams
    real_receive = streams.receive
    order = iter(_schedule_order(phase, cell, "except_last"))

    def failing_receive(
        tensor: torch.Tensor, device: torch.device, into: int, **options: bool
    ) -> torch.Tensor:
        # Only cell `cell`'s worker takes from `order`, one micro-batch per receive, in order.
        if into == cell and next(order) == m:
            raise PlantedError(f"planted in the copy of micro-batch {m}")
        return real_receive(tensor, device, into, **options)

    with no_hang(), pytest.raises(PlantedError) as caught:
        if phase == "forward":
            monkeypatch.setattr(streams, "receive", failing_receive)
        out = pipe(x.clone().requires_grad_())
        assert phase != "forward", "the copy fault did not fire"
        monkeypatch.setattr(streams, "receive", failing_receive)
        out.sum().backward()
    _check_error(caught.value, cell, m, f"boundary copy ({phase})", "planted in the copy")
    assert " pass" not in str(caught.value).split("planted")[0]
    monkeypatch.setattr(streams, "receive", real_receive)
    _check_recovers(pipe, module, x, workers)


@pytest.mark.parametrize("error", [PlantedError(), KeyError(3), OSError(5, "planted")])
def test_errors_without_a_text_message_keep_their_type_and_args(make_pipe, error) -> None:
    class Raise(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise error

    args = error.args
    pipe = make_pipe(nn.Sequential(nn.Identity(), Raise()), [1, 1], devices=["cpu"] * 2, chunks=2)
    with no_hang(), pytest.raises(type(error)) as caught:
        pipe(torch.randn(4, 2))
    assert caught.value is error and error.args == args  # nothing to prefix: args untouched
    if sys.version_info >= (3, 11):
        assert "gpipe_fast: in cell 1, micro-batch 0, forward pass" in error.__notes__


def test_failed_step_leaves_no_deferred_batch_norm_statistics(make_pipe) -> None:
    # Cell 0 normalises micro-batches 0 and 1 before cell 1 fails on micro-batch 1: those
    # statistics belong to a step that never happened and must not reach the next commit.
    class FailOnce(nn.Module):
        armed = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed and x.size(0) == 3:  # micro-batch 1 of the failing step (4 + 3)
                raise PlantedError("planted")
            return x

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), FailOnce())

    failing, clean = build(), build()
    pipes = [
        make_pipe(m, [2, 1], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
        for m in (failing, clean)
    ]
    with no_hang(), pytest.raises(PlantedError):
        pipes[0](torch.randn(7, 3) * 10 + 5)
    x = torch.randn(8, 3)
    for pipe in pipes:
        pipe(x).sum().backward()
    torch.testing.assert_close(failing[1].running_mean, clean[1].running_mean)
    torch.testing.assert_close(failing[1].running_var, clean[1].running_var)
    assert int(failing[1].num_batches_tracked) == int(clean[1].num_batches_tracked) == 1


# -- Ctrl-C --------------------------------------------------------------------------------

_INTERRUPT_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading
    import torch
    from torch import nn
    import gpipe_fast as gf

    # The phase under test holds its first task at this gate until Ctrl-C has been handled,
    # so the order is fixed by events, not by timing: signal, then the step stops.
    gate = threading.Event()
    held = {"forward": False, "backward": False}
    entered = []  # one entry per Slow task started in the phase under test

    def enter(pass_):
        if not held[pass_]:
            return
        entered.append(pass_)
        if len(entered) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while this task is in flight
            if not gate.wait(timeout=120):
                print("gate never opened: Ctrl-C was not handled", flush=True)
                os._exit(4)

    class Slow(nn.Module):
        def forward(self, x):
            return _Gate.apply(x)

    class _Gate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            enter("forward")
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            enter("backward")
            return grad

    at_signal = []

    def on_ctrl_c(signum, frame):
        at_signal.append(len(entered))
        gate.set()  # the task in flight may finish now
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)

    def check_step(pipe, model, x):
        model.zero_grad()
        pipe(x).sum().backward()
        through_pipe = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).sum().backward()
        for got, want in zip(through_pipe, [p.grad for p in model.parameters()]):
            torch.testing.assert_close(got, want)

    model = nn.Sequential(nn.Linear(4, 4), Slow(), nn.Linear(4, 4), Slow())
    pipe = gf.GPipe(model, [2, 2], devices=["cpu", "cpu"], chunks=32, checkpoint="never")
    x = torch.randn(32, 4)
    check_step(pipe, model, x)  # warm-up: torch's first-call imports are not part of the test

    # No forced GIL hand-over while the handler runs: a woken worker gets the GIL only once
    # the main thread has cancelled the run and waits, so "started no other task" is exact.
    sys.setswitchinterval(1000.0)
    # train_step runs every pass in one run; it is held at its first forward task.
    for phase in ("forward", "backward", "train_step"):
        out = pipe(x) if phase == "backward" else None
        held_pass = "backward" if phase == "backward" else "forward"
        gate.clear()
        entered.clear()
        at_signal.clear()
        held[held_pass] = True
        try:
            if phase == "forward":
                pipe(x)
            elif phase == "backward":
                out.sum().backward()
            else:
                pipe.train_step(x, x, lambda out, target: (out - target).pow(2).mean())
        except KeyboardInterrupt:
            # 32 micro-batches x 2 cells were scheduled; how many tasks started at all.
            print(phase, at_signal[0], len(entered), flush=True)
        else:
            print(phase, "not interrupted: ran all", len(entered), "tasks", flush=True)
            sys.exit(3)
        held[held_pass] = False
        del out
        check_step(pipe, model, x)  # the same pipe runs a normal step
    print("recovered", flush=True)
    """
)


def test_ctrl_c_stops_a_long_step_and_pipe_recovers(tmp_path: Path) -> None:
    # From an empty folder, so the installed package is imported, not the source tree.
    result = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = result.stdout.splitlines()
    phases = ["forward", "backward", "train_step", "recovered"]
    assert [line.split()[0] for line in lines] == phases, output
    for line in lines[:3]:
        # The signal came while the phase's first task (of 64) was held; workers finished
        # that task and started no other: one task started in all, before and after Ctrl-C.
        _, before_signal, in_all = line.split()
        assert (int(before_signal), int(in_all)) == (1, 1), output


# -- train_step: the same guarantees for every schedule's actions ---------------------------

SCHEDULE_DEVICES = {"gpipe": K, "1f1b": K, "zero_bubble": K, "interleaved": 1}


def _tagged_loss(faults: _Faults) -> Any:
    """MSE against the features that raises in micro-batch m's loss when targeted."""

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target_m = int(target[0, -1].item()) // MICROBATCH
        if faults.target == (K - 1, target_m, "loss"):
            raise PlantedError(f"planted in the loss of micro-batch {target_m}")
        return nn.functional.mse_loss(out[:, :-1], target[:, :-1])

    return loss_fn


def _train_reference(module: nn.Sequential, x: torch.Tensor, loss_fn: Any) -> list[torch.Tensor]:
    ref = copy.deepcopy(module)
    loss_fn(ref(x), x).backward()
    return [p.grad.clone() for p in ref.parameters()]  # type: ignore[union-attr]


def _train_cases() -> list[tuple[str, int, int, str]]:
    cases = []
    for schedule in SCHEDULE_DEVICES:
        wheres = ["forward", "recompute", "loss", "backward"]
        if schedule == "zero_bubble":
            wheres = ["forward", "recompute", "loss", "backward_input", "backward_weight"]
        for where, cell, m in itertools.product(wheres, (0, K - 1), (0, M - 1)):
            if where == "loss" and cell != K - 1:
                continue  # the loss belongs to the last cell
            cases.append((schedule, cell, m, where))
    return cases


@pytest.mark.parametrize(("schedule", "cell", "m", "where"), _train_cases())
def test_fault_in_a_train_step_action_reaches_caller_and_pipe_recovers(
    make_pipe, schedule: str, cell: int, m: int, where: str
) -> None:
    module, faults = _planted_model()
    checkpoint = "always" if where == "recompute" else "never"
    pipe = make_pipe(module, [3] * K, devices=["cpu"] * SCHEDULE_DEVICES[schedule], chunks=M,
                     checkpoint=checkpoint, schedule=schedule)  # fmt: skip
    x = _tagged_input()
    loss_fn = _tagged_loss(faults)
    pipe.train_step(x, x, loss_fn)  # the workers exist, and their Python state
    workers = native_threads("gpipe-cell")
    hook = None
    if where == "backward_weight":
        # Weight gradients are computed by backward_weight alone, micro-batches in order.
        calls = iter(range(M))

        def raise_at_m(grad: torch.Tensor) -> torch.Tensor:
            if next(calls) == m:
                raise PlantedError(f"planted in the backward_weight of micro-batch {m}")
            return grad

        hook = module[3 * cell].inner.weight.register_hook(raise_at_m)
    else:
        faults.target = (cell, m, "backward" if where == "backward_input" else where)
    with _activations(module) as made, no_hang(), pytest.raises(PlantedError) as caught:
        pipe.train_step(x, x, loss_fn)
    _check_error(caught.value, cell, m, f"{where} pass", f"planted in the {where.split('_')[0]}")
    del caught
    _check_freed(made)
    faults.target = None
    if hook is not None:
        hook.remove()
    assert pipeline_of(pipe).executor.live_events == 0
    module.zero_grad(set_to_none=True)
    with no_hang():
        pipe.train_step(x, x, loss_fn)
    for got, want in zip(module.parameters(), _train_reference(module, x, loss_fn), strict=True):
        torch.testing.assert_close(got.grad, want, rtol=1e-10, atol=1e-12)
    assert native_threads("gpipe-cell") == workers


def test_train_step_times_out_naming_the_cell(make_pipe) -> None:
    release = threading.Event()
    inside = threading.Event()

    class Stall(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled() or release.is_set():
                return x
            inside.set()
            release.wait(timeout=1.0)  # past the step's limit, within the 2 s grace period
            return x

    pipe = make_pipe(nn.Sequential(nn.Linear(3, 3), Stall()), [1, 1], devices=["cpu"] * 2,
                     chunks=2, schedule="1f1b")  # fmt: skip
    pipe.step_timeout = 0.3
    x = torch.randn(4, 3)
    with no_hang(), pytest.raises(TimeoutError, match=r"cell 1 never finished its forward"):
        pipe.train_step(x, x, nn.functional.mse_loss)
    assert inside.is_set()
    release.set()  # the stalled task returned within the grace period: the pipe works again
    pipe.train_step(x, x, nn.functional.mse_loss)

"""A schedule and an action written in Python: registered, validated, simulated and run exactly
(in one process and across two) through the same native path as the built-in kinds."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from cluster import Cluster, values
from schedule_from_python_cases import REVERSED, reversed_1f1b
from test_multiprocess import _check_evaluation, _check_steps
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.runtime.actions import BUILTIN
from gpipe_fast.runtime.runner import receives
from gpipe_fast.runtime.stage import Stage
from gpipe_fast.schedule.registry import action_handler, actions
from gpipe_fast.transport.protocol import ACTIVATION, GRADIENT

_names = (f"from_python_test_{n}" for n in itertools.count())


@pytest.fixture
def reversed_kind() -> Iterator[str]:
    """The reversed 1F1B kind, registered for one test and unregistered after it, so that no
    other test's list of kinds holds it."""
    if REVERSED in gf.schedules():  # left by another test of this process
        gf.unregister_schedule_kind(REVERSED)
    gf.register_schedule_kind(REVERSED, reversed_1f1b, summary="1F1B, last micro-batch first")
    yield REVERSED
    gf.unregister_schedule_kind(REVERSED)


def _model(stages: int, width: int = 5) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(stages):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers).double()


# -- (a) it is a kind like the built-in ones --------------------------------------------------


def test_a_kind_from_python_is_listed_validated_and_simulated(reversed_kind: str) -> None:
    assert gf.schedules() == (*gf.builtin_schedules(), reversed_kind)
    assert reversed_kind not in gf.builtin_schedules()
    kind = _C.schedule_kind(reversed_kind)
    assert (kind.registered, kind.stages_per_worker, kind.split_backward) == (True, 1, False)
    for stages, microbatches in [(1, 1), (2, 3), (4, 8), (3, 2)]:
        # The native path's program: 1F1B's with its micro-batches taken last first.
        plain = _C.program("1f1b", stages, stages, microbatches)
        flipped = [[(a, s, microbatches - 1 - m) for a, s, m in order] for order in plain]
        assert _C.program(reversed_kind, stages, stages, microbatches) == flipped
        for checkpoint in ("never", "except_last", "always"):
            _C.make_schedule(reversed_kind, stages, stages, microbatches, checkpoint).validate()
        # A relabelling of 1F1B: the same simulated bubble.
        assert _C.ideal_bubble(reversed_kind, stages, stages, microbatches) == pytest.approx(
            _C.ideal_bubble("1f1b", stages, stages, microbatches), rel=1e-12
        )
        # Evaluation's forward-only run keeps its forwards (and losses) in its order.
        forwards = _C.forward_program(reversed_kind, stages, stages, microbatches)
        assert forwards == [[t for t in order if t[0] in ("forward", "loss")] for order in flipped]
    assert _C.placement(reversed_kind, 3, 3) == [0, 1, 2]
    # Lowered onto two ranks, then dry-run across both, as a built-in kind is.
    program, ranks = _C.lowered_program(reversed_kind, 2, 2, 4, "never", [0, 1], True)
    assert ranks == [0, 1, 0, 0, 1, 1]
    assert ("recv_forward", 1, 3) == program[4][0]  # micro-batch 3 goes first
    for rank in (0, 1):
        _C.rank_schedule(reversed_kind, 2, 2, 4, "always", [0, 1], True, rank).validate()


def test_a_kind_from_python_may_place_its_stages_itself() -> None:
    name = next(_names)

    def backwards_placement(stage: int, stages: int, workers: int) -> int:
        return workers - 1 - stage

    def generator(stages: int, workers: int, microbatches: int) -> list[list[Any]]:
        by_worker = reversed_1f1b(stages, workers, microbatches)
        return [by_worker[stages - 1 - w] for w in range(workers)]

    gf.register_schedule_kind(name, generator, placement=backwards_placement)
    try:
        assert _C.placement(name, 3, 3) == [2, 1, 0]
        _C.make_schedule(name, 3, 3, 4).validate()
    finally:
        gf.unregister_schedule_kind(name)


# -- (b) exact in one process ------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_kind_from_python_trains_exactly_in_one_process(
    make_pipe: Any, reversed_kind: str, checkpoint: str
) -> None:
    stages = 3
    model = _model(stages)
    x = torch.randn(11, 5, dtype=torch.float64)
    y = torch.randn(11, 5, dtype=torch.float64)
    ref = copy.deepcopy(model)
    rx = x.clone().requires_grad_()
    want = nn.functional.mse_loss(ref(rx), y)
    want.backward()
    pipe = make_pipe(model, [2] * stages, devices=["cpu"] * stages, chunks=4,
                     checkpoint=checkpoint, schedule=reversed_kind)  # fmt: skip
    px = x.clone().requires_grad_()
    loss = pipe.train_step(px, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(px.grad, rx.grad, rtol=1e-10, atol=1e-12)
    for (name, got), wanted in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got.grad, wanted.grad, rtol=1e-10, atol=1e-12, msg=name)
    # Evaluation: the kind's forward-only run.
    with torch.no_grad():
        plain = nn.functional.mse_loss(ref(x), y)
    torch.testing.assert_close(pipe.eval_step(x, y, nn.functional.mse_loss), plain,
                               rtol=1e-12, atol=0)  # fmt: skip


# -- (c) exact across two processes ------------------------------------------------------------


def test_a_kind_from_python_trains_and_evaluates_exactly_on_two_processes(two: Cluster) -> None:
    batches = [12, 9, 3]  # even, uneven, fewer rows than micro-batches
    results = values(two.run("schedule_from_python_cases.train", layers=4, balance=[4, 4],
                             chunks=4, checkpoint="except_last", batches=batches, pp=2,
                             dp=1))  # fmt: skip
    _check_steps(results, 4, batches)
    results = values(two.run("schedule_from_python_cases.evaluate", layers=4, balance=[4, 4],
                             chunks=4, batches=batches, pp=2, dp=1))  # fmt: skip
    _check_evaluation(results, batches, replicas=1)


# -- (d) an action from Python, with its handler, under train_step ------------------------------

RECORD = "record_grads_test"
recorded: list[tuple[int, int, list[torch.Tensor]]] = []


def _record(stage: Stage, microbatch: int) -> None:
    """The stage's gradients as they stand after micro-batch `microbatch`'s backward."""
    grads = [p.grad.clone() for p in stage.cell.module.parameters()]  # type: ignore[union-attr]
    recorded.append((stage.index, microbatch, grads))


def _with_records(stages: int, workers: int, microbatches: int) -> list[list[Any]]:
    """1F1B with a record after every backward."""
    program = []
    for order in _C.program("1f1b", stages, workers, microbatches):
        tasks = []
        for task in order:
            tasks.append(task)
            if task[0] == "backward":
                tasks.append((RECORD, task[1], task[2]))
        program.append(tasks)
    return program


def test_an_action_from_python_runs_its_handler_under_train_step(make_pipe: Any) -> None:
    if RECORD not in actions():  # actions are registered for good: once per process
        gf.register_action(RECORD, [gf.Need([("backward", 0)])], handler=_record)
    kind = next(_names)
    gf.register_schedule_kind(kind, _with_records)
    recorded.clear()
    try:
        stages, batch, chunks = 2, 8, 4
        model = _model(stages)
        x = torch.randn(batch, 5, dtype=torch.float64)
        y = torch.randn(batch, 5, dtype=torch.float64)
        pipe = make_pipe(model, [2] * stages, devices=["cpu"] * stages, chunks=chunks,
                         schedule=kind)  # fmt: skip
        pipe.train_step(x, y, nn.functional.mse_loss)
    finally:
        gf.unregister_schedule_kind(kind)
    # Each micro-batch's part of the whole-batch loss, and its gradients on the whole model.
    parts = []
    for m in range(chunks):
        ref = copy.deepcopy(model)
        ref.zero_grad(set_to_none=True)
        rows = slice(m * batch // chunks, (m + 1) * batch // chunks)
        (((ref(x[rows]) - y[rows]) ** 2).sum() / y.numel()).backward()
        parts.append([p.grad for p in ref.parameters() if p.grad is not None])
    per_stage = len(parts[0]) // stages  # a Linear's weight and bias per stage
    # One record per (stage, micro-batch), in the order 1F1B runs each stage's backwards.
    for k in range(stages):
        mine = [(m, grads) for s, m, grads in recorded if s == k]
        want_order = [m for a, s, m in _C.program("1f1b", stages, stages, chunks)[k]
                      if a == "backward"]  # fmt: skip
        assert [m for m, _ in mine] == want_order
        # After each backward, the gradients are the sum over the micro-batches done so far.
        done: list[int] = []
        for m, grads in mine:
            done.append(m)
            for i, got in enumerate(grads):
                want = torch.stack([parts[d][k * per_stage + i] for d in done]).sum(0)
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# -- (e) bad registrations ---------------------------------------------------------------------


def test_bad_kind_registrations_are_refused_naming_the_kind(
    make_pipe: Any, reversed_kind: str
) -> None:
    before = gf.schedules()
    for taken in ("1f1b", reversed_kind):
        with pytest.raises(ValueError, match=f"schedule '{taken}' is already registered"):
            gf.register_schedule_kind(taken, reversed_1f1b)
    name = next(_names)
    with pytest.raises(ValueError, match=f"schedule '{name}': generator must be a callable"):
        gf.register_schedule_kind(name, "1f1b")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"schedule '{name}': placement must be 'round_robin'"):
        gf.register_schedule_kind(name, reversed_1f1b, placement="diagonal")
    with pytest.raises(ValueError, match=f"schedule '{name}': stages_per_worker must be >= 0"):
        gf.register_schedule_kind(name, reversed_1f1b, stages_per_worker=-1)
    with pytest.raises(TypeError, match="stages_per_worker must be an int"):
        gf.register_schedule_kind(name, reversed_1f1b, stages_per_worker=True)
    with pytest.raises(ValueError, match="schedule name 'Not Snake' must be"):
        gf.register_schedule_kind("Not Snake", reversed_1f1b)
    with pytest.raises(ValueError, match="'gpipe' is built in"):
        gf.unregister_schedule_kind("gpipe")
    with pytest.raises(ValueError, match=f"schedule '{name}' is not registered"):
        gf.unregister_schedule_kind(name)
    with pytest.raises(ValueError, match="handler must be callable"):
        gf.register_action(next(_names), [gf.Need([("forward", 0)])], handler=3)  # type: ignore[arg-type]
    assert gf.schedules() == before


def _backward_before_forward(stages: int, workers: int, microbatches: int) -> list[list[Any]]:
    return [list(reversed(order)) for order in reversed_1f1b(stages, workers, microbatches)]


@pytest.mark.parametrize(
    ("generator", "placement", "match"),
    [
        (_backward_before_forward, "round_robin", "which its worker runs after it"),
        (lambda s, w, m: reversed_1f1b(s, w, m)[:-1], "round_robin", "worker lists, not"),
        (lambda s, w, m: [[("frobnicate", 0, 0)]] * w, "round_robin", "unknown action"),
        (lambda s, w, m: [[("forward", 0, m)]] * w, "round_robin", "outside the pipeline"),
        (lambda s, w, m: 7, "round_robin", "must return, per worker, a list"),
        (reversed_1f1b, lambda s, n, w: w, None),
    ],
    ids=["order", "workers", "action", "microbatch", "type", "placement"],
)
def test_a_kind_whose_programs_are_invalid_fails_naming_it(
    make_pipe: Any, generator: Any, placement: Any, match: str | None
) -> None:
    name = next(_names)
    gf.register_schedule_kind(name, generator, placement=placement)
    try:
        if match is None:  # the placement puts a stage on a worker that is not there
            with pytest.raises(ValueError, match=f"schedule '{name}' places stage 0 on worker 2"):
                _C.placement(name, 2, 2)
            return
        with pytest.raises(ValueError, match=f"schedule '{name}' generated an invalid program"):
            _C.make_schedule(name, 2, 2, 3)
        pipe = make_pipe(_model(2), [2, 2], devices=["cpu"] * 2, chunks=3, schedule=name)
        x = torch.randn(6, 5, dtype=torch.float64)
        with pytest.raises(ValueError, match=f"schedule '{name}' generated an invalid program.*"
                           + match):  # fmt: skip
            pipe.train_step(x, x, nn.functional.mse_loss)
    finally:
        gf.unregister_schedule_kind(name)


def test_an_action_without_handler_names_itself_when_a_step_runs_it(make_pipe: Any) -> None:
    action = next(_names)
    gf.register_action(action, [gf.Need([("forward", 0)])])
    kind = next(_names)

    def generator(stages: int, workers: int, microbatches: int) -> list[list[Any]]:
        program = reversed_1f1b(stages, workers, microbatches)
        program[0].insert(1, (action, 0, microbatches - 1))
        return program

    gf.register_schedule_kind(kind, generator)
    try:
        pipe = make_pipe(_model(2), [2, 2], devices=["cpu"] * 2, chunks=2, schedule=kind)
        x = torch.randn(4, 5, dtype=torch.float64)
        with pytest.raises(NotImplementedError, match=f"no handler for action '{action}'"):
            pipe.train_step(x, x, nn.functional.mse_loss)
    finally:
        gf.unregister_schedule_kind(kind)


def test_the_runtime_reads_actions_by_their_facts_and_handlers() -> None:
    # The runner posts the headers of the actions whose facts say they receive an activation
    # or a gradient, and each built-in action's handler is the Stage method of its name.
    facts = {fact.name: fact for fact in _C.action_facts()}
    flows = receives()
    assert flows == {"recv_forward": ACTIVATION, "recv_backward": GRADIENT}
    assert all(facts[name].communication for name in flows)
    assert actions()[: len(BUILTIN)] == list(BUILTIN)
    for name in BUILTIN:
        assert action_handler(name) is getattr(Stage, name)

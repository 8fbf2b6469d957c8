"""schedule/chunks/checkpoint "auto" in one process: what the tuning chooses, reports and leaves.

No test asserts a time: the choice depends on the machine, so each checks what holds whatever
is chosen (the step equals the chosen configuration's, nothing of the model moves, the
choice is kept per input signature, the report lists what ran)."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast.api import auto
from gpipe_fast.planning import measure, price, tune

# net() holds BatchNorm on purpose (buffers that a step moves): the warning chunks="auto" then
# gives is tested once (test_chunks_tuned_over_batchnorm_warns_...).
pytestmark = pytest.mark.filterwarnings("ignore:.*chunks='auto' with BatchNorm:UserWarning")


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few candidates and steps: the tests check behaviour, not the choice."""
    monkeypatch.setattr(tune, "MOST_MEASURED", 3)
    monkeypatch.setattr(tune, "FIRST_MEASURED", 2)
    monkeypatch.setattr(tune, "CHEAP_S", 0.0)
    monkeypatch.setattr(measure, "TIMED_STEPS", 2)
    monkeypatch.setattr(measure, "MIN_TIMED_S", 0.0)
    monkeypatch.setattr(measure, "TURN_S", 0.0)
    monkeypatch.setattr(price, "PROFILE_WARMUP", 0)
    monkeypatch.setattr(price, "PROFILE_REPEATS", 1)


@pytest.fixture
def pipes() -> Iterator[list[Any]]:
    built: list[Any] = []
    yield built
    for pipe in built:
        pipe.close()


def net() -> nn.Sequential:
    """Float64 layers with BatchNorm (buffers that a step moves) and dropout (randomness)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.Tanh()]
    return nn.Sequential(*layers).double()


def batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 8, dtype=torch.float64, generator=generator)
    return x, torch.randn(rows, 8, dtype=torch.float64, generator=generator)


def auto_pipe(module: nn.Module, pipes: list[Any], **kwargs: Any) -> gf.GPipe:
    options = {"schedule": "auto", "chunks": "auto", "checkpoint": "auto", **kwargs}
    pipe = gf.GPipe(module, devices=["cpu", "cpu"], **options)  # type: ignore[arg-type]
    pipes.append(pipe)
    return pipe


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def state_of(pipe: gf.GPipe) -> tuple[dict[str, torch.Tensor], list[torch.Tensor | None]]:
    values = {k: v.clone() for k, v in pipe.state_dict().items()}
    grads = [None if p.grad is None else p.grad.clone() for p in pipe.parameters()]
    return values, grads


def test_the_first_step_tunes_then_runs_as_the_chosen_pipe_would(pipes: list[Any]) -> None:
    module = net()
    plain = copy.deepcopy(module)
    x, y = batch()
    pipe = auto_pipe(module, pipes)
    assert pipe.tuning is None
    seed = torch.get_rng_state()
    loss = pipe.train_step(x, y, loss_fn)
    choice = pipe.tuning.choice
    assert (pipe.schedule, tuple(pipe.balance)) == (choice.cut.schedule, choice.cut.balance)
    assert (pipe.chunks, pipe.checkpoint) == (choice.chunks, choice.checkpoint)

    # The same step through a pipe built with the choice, from the same generator state:
    # the same dropout masks, loss, gradients and running statistics, bit for bit.
    chosen = gf.GPipe(plain, list(choice.cut.balance), devices=["cpu", "cpu"],
                      schedule=choice.cut.schedule, chunks=choice.chunks,
                      checkpoint=choice.checkpoint)  # fmt: skip
    pipes.append(chosen)
    torch.set_rng_state(seed)
    want = chosen.train_step(x, y, loss_fn)
    assert torch.equal(loss, want)
    for got, expected in zip(pipe.parameters(), chosen.parameters(), strict=True):
        assert torch.equal(got.grad, expected.grad)
    for got, expected in zip(pipe.buffers(), chosen.buffers(), strict=True):
        assert torch.equal(got, expected)


def test_chunks_tuned_over_batchnorm_warns_that_the_values_follow_the_choice(
    pipes: list[Any],
) -> None:
    # Each micro-batch is normalised by its own rows: the count chosen by speed changes the
    # loss and gradients (tests/test_tune_processes.py checks them against the plain model's).
    x, y = batch()
    with pytest.warns(UserWarning, match=r"chunks='auto' with BatchNorm .*\(1, 5, 9 and 1 more\)"):
        auto_pipe(net(), pipes).train_step(x, y, loss_fn)
    with warnings.catch_warnings(record=True) as caught:  # chunks given: nothing to say
        warnings.simplefilter("always")
        auto_pipe(net(), pipes, chunks=2).train_step(x, y, loss_fn)
    assert not [w for w in caught if "BatchNorm" in str(w.message)]


def test_tuning_moves_nothing_of_the_model(pipes: list[Any]) -> None:
    x, y = batch()
    x.requires_grad_()
    pipe = auto_pipe(net(), pipes, chunks=2, checkpoint="never")
    optimizer = torch.optim.AdamW(pipe.parameters())
    pipe.train_step(x, y, loss_fn)  # tunes, then leaves gradients and statistics behind
    optimizer.step()
    values, grads = state_of(pipe)
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    input_grad = x.grad.clone()
    generator = torch.get_rng_state()

    tuning = pipe.tune(x, y, loss_fn, progress=False)

    assert tuning.measured  # it ran steps
    after_values, after_grads = state_of(pipe)
    assert values.keys() == after_values.keys()
    for key, value in values.items():
        assert torch.equal(after_values[key], value), key
    for before, after in zip(grads, after_grads, strict=True):
        assert before is not None and after is not None and torch.equal(before, after)
    assert torch.equal(x.grad, input_grad)
    assert torch.equal(torch.get_rng_state(), generator)
    state = optimizer.state_dict()["state"]
    for index, entries in optimizer_state["state"].items():
        for name, value in entries.items():
            assert torch.equal(torch.as_tensor(state[index][name]), torch.as_tensor(value))


def test_a_gradient_held_before_tuning_is_the_same_tensor_after(pipes: list[Any]) -> None:
    x, y = batch()
    pipe = auto_pipe(net(), pipes, schedule="1f1b", checkpoint="never")
    pipe.train_step(x, y, loss_fn)
    held = [p.grad for p in pipe.parameters()]
    pipe.tune(x, y, loss_fn, progress=False)
    assert all(p.grad is g for p, g in zip(pipe.parameters(), held, strict=True))


def test_the_choice_is_kept_per_input_signature(pipes: list[Any], monkeypatch: pytest.MonkeyPatch
                                                ) -> None:  # fmt: skip
    calls: list[int] = []
    real = auto._TUNER[0]

    def counting(pipe: Any, *args: Any) -> Any:
        calls.append(args[-1])
        return real(pipe, *args)

    monkeypatch.setattr(auto, "_TUNER", [counting])
    pipe = auto_pipe(net(), pipes)
    eight, four = batch(8), batch(4)
    pipe.train_step(*eight, loss_fn)
    first = pipe.tuning
    pipe.train_step(*eight, loss_fn)
    assert len(calls) == 1 and pipe.tuning is first
    pipe.train_step(*four, loss_fn)  # another batch size: another signature, tuned anew
    assert len(calls) == 2 and pipe.tuning is not first
    second = pipe.tuning
    # After the first tuning the cut stays: only chunks and checkpoint are chosen again.
    assert second.choice.cut == first.choice.cut
    assert {c.config.cut for c in second.candidates} == {first.choice.cut}
    pipe.train_step(*eight, loss_fn)  # back to the first: its choice, not a third tuning
    assert len(calls) == 2 and pipe.tuning is first
    assert (pipe.chunks, pipe.checkpoint) == (first.choice.chunks, first.choice.checkpoint)
    assert set(pipe._auto.tunings) == {first.signature, second.signature}


def test_a_step_checks_its_signature_in_its_own_agreement(pipes: list[Any],
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:  # fmt: skip
    # After the first step, the step's batch agreement carries cell 0's signature (across
    # processes: no message of its own); a new one stops the step before any task and runs it
    # again on that signature's choice, once.
    agreements: list[int] = []
    real = auto.signature

    def agreeing(*args: Any) -> int:
        agreements.append(1)
        return real(*args)

    monkeypatch.setattr(auto, "signature", agreeing)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]).double()
    plain = copy.deepcopy(model)
    pipe = auto_pipe(model, pipes)
    eight, four = batch(8), batch(4)
    pipe.train_step(*eight, loss_fn)
    assert len(agreements) == 1
    runs: list[int | None] = []
    real_run = pipe._pipeline.run

    def run(request: Any, *args: Any) -> Any:
        runs.append(request.signature)
        return real_run(request, *args)

    monkeypatch.setattr(pipe._pipeline, "run", run)
    pipe.train_step(*eight, loss_fn)
    assert len(agreements) == 1 and runs == [pipe.tuning.signature]
    first = pipe.tuning.signature
    loss = pipe.train_step(*four, loss_fn)
    # Stopped at the agreement, tuned (its steps check nothing), then run on the new choice.
    assert runs[1] == first and set(runs[2:]) == {None} and len(runs) > 3
    assert pipe.tuning.signature != first and len(agreements) == 1
    assert torch.allclose(loss, loss_fn(plain(four[0]), four[1]), rtol=1e-12, atol=0)


def test_the_report_lists_every_candidate_and_the_choice(pipes: list[Any]) -> None:
    x, y = batch()
    pipe = auto_pipe(net(), pipes)
    tuning = pipe.tune(x, y, loss_fn, progress=False)
    assert isinstance(tuning, gf.Tuning) and pipe.tuning is tuning
    configs = [c.config for c in tuning.candidates]
    assert len(configs) == len(set(configs)) > 3
    assert tuning.choice in configs
    ran = tuning.measured
    assert 1 <= len(ran) <= tune.MOST_MEASURED
    fastest = min(c.measured_s for c in ran)  # type: ignore[type-var]
    if tuning.chosen.measured_s != fastest:
        # The defaults ran beside the fastest within TIE of it, and stay.
        assert any("kept the defaults" in note for note in tuning.notes), tuning.notes
        assert tuning.chosen.measured_s <= fastest * (1 + tune.TIE)
    for candidate in tuning.candidates:
        assert candidate.predicted_s is not None and candidate.predicted_s > 0
        assert candidate.calibrated_s is not None and candidate.calibrated_s > 0
        assert candidate.peak_memory > 0
    # Ranked by gf.plan's prediction, fastest first.
    predicted = [c.predicted_s for c in tuning.candidates]
    assert predicted == sorted(predicted)  # type: ignore[type-var]
    # Every schedule kind, checkpoint mode and divisor of the batch was priced.
    assert {c.cut.schedule for c in configs} == set(gf.schedules())
    assert {c.checkpoint for c in configs} == {"never", "except_last", "always"}
    assert {c.chunks for c in configs} == {1, 2, 4}  # 8: one row each, BatchNorm refuses
    # The plan of the choice is calibrated from its own steps.
    plan = tuning.plan
    assert plan is not None and plan.calibrated
    assert (plan.schedule, plan.chunks, plan.checkpoint) == (
        tuning.choice.cut.schedule, tuning.choice.chunks, tuning.choice.checkpoint)  # fmt: skip
    assert plan.balance == list(tuning.choice.cut.balance)
    # Its step is the choice's as the tuning timed it (not its slower recorded steps').
    assert plan.step_time == pytest.approx(tuning.chosen.measured_s, rel=1e-3)
    assert tuning.fit is not None and tuning.fit.scale > 0
    assert tuning.seconds > 0 and tuning.measured_steps == measure.TIMED_STEPS
    text = str(tuning)
    assert f"chose {tuning.choice}" in text and "measured ms" in text


def test_only_what_is_auto_is_tuned(pipes: list[Any]) -> None:
    x, y = batch()
    pipe = auto_pipe(net(), pipes, schedule="1f1b", checkpoint="never")
    tuning = pipe.tune(x, y, loss_fn, progress=False)
    assert {c.config.cut for c in tuning.candidates} == {auto.Cut("1f1b", (8, 8))}
    assert {c.config.checkpoint for c in tuning.candidates} == {"never"}
    assert len({c.config.chunks for c in tuning.candidates}) > 1
    given = auto_pipe(net(), pipes, balance=[4, 12], chunks=2)  # a balance given: kept
    tuning = given.tune(x, y, loss_fn, progress=False)
    assert {c.config.cut.balance for c in tuning.candidates} == {(4, 12)}
    assert {c.config.chunks for c in tuning.candidates} == {2}
    assert given.balance == [4, 12]


def test_a_progress_bar_shows_while_tuning(pipes: list[Any], capsys: pytest.CaptureFixture[str]
                                           ) -> None:  # fmt: skip
    x, y = batch()
    pipe = auto_pipe(net(), pipes)
    pipe.train_step(x, y, loss_fn)
    err = capsys.readouterr().err
    assert "gpipe_fast tuning [" in err and "pricing the candidates" in err
    assert "running " in err and f"chose {pipe.tuning.choice}" in err
    pipe.tune(x, y, loss_fn, progress=False)
    assert capsys.readouterr().err == ""


def test_a_memory_budget_leaves_out_what_does_not_fit(pipes: list[Any]) -> None:
    x, y = batch()
    pipe = auto_pipe(net(), pipes)
    with pytest.raises(ValueError, match="memory_per_device: no candidate"):
        pipe.tune(x, y, loss_fn, memory_per_device=1, progress=False)
    everything = pipe.tune(x, y, loss_fn, progress=False)
    peaks = sorted(c.peak_memory for c in everything.candidates)
    budget = peaks[len(peaks) // 2]
    fresh = auto_pipe(net(), pipes)
    tuning = fresh.tune(x, y, loss_fn, memory_per_device=budget, progress=False)
    assert all(c.peak_memory <= budget for c in tuning.candidates)
    assert any("predicted peak over" in note for note in tuning.notes)


def test_a_time_budget_runs_one_candidate(pipes: list[Any]) -> None:
    x, y = batch()
    pipe = auto_pipe(net(), pipes)
    tuning = pipe.tune(x, y, loss_fn, budget_s=0.0, progress=False)
    assert len(tuning.measured) == 1


def test_a_candidate_that_fails_is_reported_and_skipped(pipes: list[Any]) -> None:
    # BatchNorm cannot train on one row: gf.plan cannot price chunks = the batch, and says so.
    x, y = batch(4)
    pipe = auto_pipe(net(), pipes)
    tuning = pipe.tune(x, y, loss_fn, progress=False)
    assert 4 not in {c.config.chunks for c in tuning.candidates}
    assert any("Expected more than 1 value per channel" in note for note in tuning.notes)


def test_the_unet_with_skips_tunes_and_stays_exact(pipes: list[Any]) -> None:
    from gpipe_fast.demo.unet import batch as unet_batch
    from gpipe_fast.demo.unet import unet

    torch.manual_seed(0)
    module = unet().double()
    plain = copy.deepcopy(module)
    x, y = (t.double() for t in unet_batch(0, size=8, pixels=16))
    pipe = auto_pipe(module, pipes)
    loss = pipe.train_step(x, y, loss_fn)
    want = loss_fn(plain(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    for got, expected in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-9, atol=1e-12)


def test_a_transformers_llama_through_gf_pipeline_tunes_its_split_points(pipes: list[Any]
                                                                          ) -> None:  # fmt: skip
    pytest.importorskip("transformers")
    from any_model_cases import any_loss, inputs, llama, targets

    model = llama()
    plain = copy.deepcopy(model)
    example = inputs("llama", 2, 12, 0)
    pipe = gf.pipeline(model, example, schedule="auto", chunks="auto", checkpoint="auto")
    pipes.append(pipe)
    data = inputs("llama", 4, 12, 1)
    loss = pipe.train_step(data, targets("llama", data), any_loss)
    tuning = pipe.tuning
    assert len({c.config.cut.split_points for c in tuning.candidates}) > 1
    assert pipe.split_points == list(tuning.choice.cut.split_points)
    want = any_loss(plain(**data), targets("llama", data))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    named = dict(plain.named_parameters())
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param.grad, named[name].grad, rtol=1e-9, atol=1e-12)


def test_bad_uses_are_named() -> None:
    with pytest.raises(TypeError, match="chunks must be an int"):
        gf.GPipe(net(), chunks="fast")
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        gf.GPipe(net(), checkpoint="Auto")
    pipe = gf.GPipe(net(), devices=["cpu", "cpu"], chunks=2)
    try:
        with pytest.raises(ValueError, match="nothing to tune"):
            pipe.tune(*batch(), loss_fn)
        assert pipe.tuning is None
    finally:
        pipe.close()


def test_a_pipe_rebuilt_with_another_cut_keeps_the_models_tensors_and_keys(
    pipes: list[Any],
) -> None:
    from helpers import native_threads

    before_threads = native_threads("gpipe-cell")
    module = net()
    params = {id(p) for p in module.parameters()}
    keys = set(module.state_dict())
    pipe = auto_pipe(module, pipes)
    pipe.train()
    pipe.step_timeout = 60.0
    initial = pipe.balance
    # Whatever runs fastest here, the choice must re-cut the model: the pipe's own balance
    # is left out of the candidates.
    candidate_cuts = price.Pricing.cuts

    def others(self: Any, *args: Any) -> list[Any]:
        return [lay for lay in candidate_cuts(self, *args) if list(lay.balance) != initial]

    price.Pricing.cuts = others  # type: ignore[method-assign]
    try:
        tuning = pipe.tune(*batch(), loss_fn, progress=False)
    finally:
        price.Pricing.cuts = candidate_cuts  # type: ignore[method-assign]
    assert pipe.balance != initial and pipe.balance == list(tuning.choice.cut.balance)
    assert {id(p) for p in pipe.parameters()} == params  # the model's own, not copies
    assert set(pipe.state_dict()) == keys
    pipe.load_state_dict(module.state_dict())
    assert pipe.training and pipe.step_timeout == 60.0 and pipe.tuning is tuning
    workers = len(set(pipe._pipeline.stage_workers))
    # The candidates' pipes and the first runtime are closed: only the chosen one's remain.
    assert native_threads("gpipe-cell") - before_threads == workers


class Uncopyable(nn.Linear):
    """A layer gf.plan cannot profile apart (deepcopy refuses its non-leaf attribute)."""

    def __init__(self) -> None:
        super().__init__(8, 8, dtype=torch.float64)
        self.scale = torch.ones(8, dtype=torch.float64, requires_grad=True) * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale.detach()


def test_without_gf_plan_the_candidates_run_in_a_fixed_order(pipes: list[Any]) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(Uncopyable(), nn.Tanh(), nn.Linear(8, 8).double(), nn.Tanh())
    pipe = auto_pipe(module, pipes)
    tuning = pipe.tune(*batch(), loss_fn, progress=False)
    assert any("gf.plan could not price" in note for note in tuning.notes)
    assert all(c.predicted_s is None and c.calibrated_s is None for c in tuning.candidates)
    assert tuning.plan is None and len(tuning.measured) == tune.MOST_MEASURED
    assert tuning.chosen.measured_s == min(c.measured_s for c in tuning.measured)  # type: ignore[type-var]
    assert "chose" in str(tuning)


def test_a_loss_that_fails_fails_the_tuning_with_its_own_error(pipes: list[Any]) -> None:
    pipe = auto_pipe(net(), pipes)
    values, _ = state_of(pipe)

    def broken(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ValueError("the target is not what the loss wants")

    with pytest.raises(ValueError, match="the target is not what the loss wants"):
        pipe.train_step(*batch(), broken)
    assert pipe.tuning is None
    assert all(p.grad is None for p in pipe.parameters())
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, values[key])
    pipe.train_step(*batch(), loss_fn)  # and it tunes once the loss works
    assert pipe.tuning is not None


def test_gf_plan_takes_the_tunings_calibration(pipes: list[Any]) -> None:
    x, y = batch()
    pipe = auto_pipe(net(), pipes)
    tuning = pipe.tune(x, y, loss_fn, progress=False)
    plan = gf.plan(net(), x, 2, 2, schedule="1f1b", checkpoint="never", devices=2,
                   calibrate=tuning)  # fmt: skip
    assert plan.calibrated and tuning.fit is not None
    fit = tuning.fit.of_kind("1f1b")  # the kind's correction, where the tuning ran it
    assert (plan.overhead, plan.call_overhead) == (fit.handoff, fit.call)
    profiled = gf.plan(net(), x, 2, 2, balance=plan.balance, schedule="1f1b",
                       checkpoint="never", devices=2)  # fmt: skip
    assert not profiled.calibrated and profiled.step_time != plan.step_time
    with pytest.raises(ValueError, match="calibrate: calibrating measures time"):
        gf.plan(net(), x, 2, 2, cost="params", schedule="1f1b", checkpoint="never",
                calibrate=tuning)  # fmt: skip


def test_the_defaults_are_measured_among_the_candidates(pipes: list[Any],
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:  # fmt: skip
    # So that "auto" is never slower than leaving it out, as far as its measurements tell.
    monkeypatch.setattr(tune, "MOST_MEASURED", 4)
    x, y = batch()
    pipe = auto_pipe(net(), pipes)
    built = auto.Cut("gpipe", tuple(pipe.balance))
    tuning = pipe.tune(x, y, loss_fn, progress=False)
    defaults = auto.Config(built, 1, "except_last")  # GPipe's chunks and checkpoint
    assert defaults in [c.config for c in tuning.measured]
    assert tuning.chosen.measured_s <= next(  # type: ignore[operator]
        c.measured_s for c in tuning.measured if c.config == defaults
    )


def test_small_steps_are_timed_for_about_min_timed_s(pipes: list[Any],
                                                      monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:  # fmt: skip
    monkeypatch.setattr(measure, "MIN_TIMED_S", 0.2)
    found: list[Any] = []
    original = tune.measure

    def recorded(*args: Any) -> Any:
        found.append(original(*args))
        return found[-1]

    monkeypatch.setattr(tune, "measure", recorded)
    x, y = batch()
    auto_pipe(net(), pipes).tune(x, y, loss_fn, progress=False)
    assert found
    for measurement in found:  # a step of a few milliseconds: more than the recorded ones
        assert measure.TIMED_STEPS < measurement.steps <= measure.MOST_TIMED_STEPS
        enough = measurement.steps * measurement.seconds >= 0.2 * 0.5
        assert enough or measurement.steps == measure.MOST_TIMED_STEPS


def test_a_side_by_side_turn_runs_about_turn_s_of_steps_and_times_the_settled_half(
    pipes: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Steps of a few milliseconds take several steps to settle after another pipe's: a turn
    # of two steps ranked them as they start, not as a training loop runs them.
    monkeypatch.setattr(measure, "TURN_S", 0.05)
    assert measure.turn_steps(0.2) == measure.BLOCK
    assert measure.turn_steps(0.005) == 10
    ran: list[Any] = []

    def timed(pipe: Any, step: Any, params: Any) -> float:
        ran.append(pipe)
        first_half = (len(ran) - 1) % 10 < 5  # unsettled: slow
        return 1.0 if first_half else 0.001 * (1 + (pipe is pipes[1]))

    monkeypatch.setattr(measure, "_timed", timed)
    pipe = auto_pipe(net(), pipes)
    other = auto_pipe(net(), pipes)
    configs = [auto.Config(auto.Cut("gpipe", tuple(p.balance)), 1, "never") for p in pipes]
    agreement = measure.Agreement(pipe.layout)
    seconds = measure.side_by_side([pipe, other], configs, None, agreement, rounds=3, turn=10)
    assert seconds == [0.001, 0.002]  # the latter half of each turn only
    assert len(ran) == 2 * 3 * 10
    turns = [ran[i : i + 10] for i in range(0, len(ran), 10)]
    assert all(len(set(map(id, t))) == 1 for t in turns)  # one pipe's steps one after another
    assert [t[0] is pipe for t in turns] == [True, False, False, True, True, False]


def test_the_calibration_corrects_each_schedule_kind_it_measured(pipes: list[Any]) -> None:
    x, y = batch()
    tuning = auto_pipe(net(), pipes).tune(x, y, loss_fn, progress=False)
    assert tuning.fit is not None
    kinds: dict[str, list[Any]] = {}
    for candidate in tuning.measured:
        kinds.setdefault(candidate.config.cut.schedule, []).append(candidate)
    assert set(tuning.fit.by_kind) == set(kinds)
    for ran in kinds.values():
        if len(ran) == 1:  # a kind measured once: its calibrated step is the one measured
            assert ran[0].calibrated_s == pytest.approx(ran[0].measured_s, rel=1e-6)


def test_while_measuring_is_cheap_more_candidates_run(pipes: list[Any],
                                                      monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:  # fmt: skip
    # Steps of milliseconds: gf.plan's prediction is too far off to leave candidates out.
    monkeypatch.setattr(tune, "CHEAP_S", 1e6)
    monkeypatch.setattr(tune, "MOST_CHEAP", 6)
    x, y = batch()
    tuning = auto_pipe(net(), pipes).tune(x, y, loss_fn, progress=False)
    assert len(tuning.measured) == 6 > tune.MOST_MEASURED
    monkeypatch.setattr(tune, "CHEAP_S", 0.0)
    tuning = auto_pipe(net(), pipes).tune(x, y, loss_fn, progress=False)
    assert len(tuning.measured) <= tune.MOST_MEASURED


def test_the_pipe_warms_up_before_the_first_candidate_and_the_defaults_run_in_the_final(
    pipes: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh process's first steps run slower: the first candidate measured would seem slow.
    # And the defaults, measured, run side by side with the best: no pick that merely
    # measured faster than them at another moment.
    events: list[str] = []
    warm_up, measured = measure.warm_up, tune.measure
    monkeypatch.setattr(measure, "warm_up", lambda *a: (events.append("warm"), warm_up(*a)))
    monkeypatch.setattr(tune, "measure", lambda *a: (events.append("measure"), measured(*a))[1])
    finals: list[list[Any]] = []
    side_by_side = tune.side_by_side
    monkeypatch.setattr(tune, "side_by_side",
                        lambda p, configs, *a: (finals.append(list(configs)),
                                                side_by_side(p, configs, *a))[1])  # fmt: skip
    monkeypatch.setattr(tune, "MOST_MEASURED", 4)
    monkeypatch.setattr(tune, "CLOSE", 10.0)  # every measured candidate is close
    monkeypatch.setattr(tune, "FINALISTS", 2)
    x, y = batch()
    pipe = auto_pipe(net(), pipes)
    defaults = auto.Config(auto.Cut("gpipe", tuple(pipe.balance)), 1, "except_last")
    tuning = pipe.tune(x, y, loss_fn, progress=False)
    assert events[0] == "warm" and events.count("warm") == 1
    assert defaults in [c.config for c in tuning.measured]
    assert len(finals) == 1 and len(finals[0]) == 2 and defaults in finals[0]
    # Measured beyond 2 * CLOSE of the best, the defaults stay out of the final.
    finals.clear()
    monkeypatch.setattr(tune, "CLOSE", 0.5)

    def slow_defaults(pipe: Any, config: Any, *a: Any) -> Any:
        found = measured(pipe, config, *a)
        return dataclasses.replace(found, seconds=found.seconds * 10) if config == defaults \
            else found  # fmt: skip

    monkeypatch.setattr(tune, "measure", slow_defaults)
    tuning = auto_pipe(net(), pipes).tune(x, y, loss_fn, progress=False)
    assert defaults in [c.config for c in tuning.measured]
    assert all(defaults not in final for final in finals)


@pytest.mark.parametrize(("slower", "kept"), [(1.02, True), (1.05, False)])
def test_the_defaults_stay_unless_the_pick_ran_more_than_tie_faster_beside_them(
    pipes: list[Any], monkeypatch: pytest.MonkeyPatch, slower: float, kept: bool
) -> None:
    # Side by side in the final, the defaults 2% slower than the fastest: a gain within what
    # a host's drift makes of a step, so the pipe runs as it would without "auto"; 5%: the
    # fastest is picked.
    monkeypatch.setattr(tune, "MOST_MEASURED", 4)
    monkeypatch.setattr(tune, "CLOSE", 10.0)  # every measured candidate is close
    monkeypatch.setattr(tune, "FINALISTS", 2)
    pipe = auto_pipe(net(), pipes)
    defaults = auto.Config(auto.Cut("gpipe", tuple(pipe.balance)), 1, "except_last")

    def side_by_side(p: Any, configs: list[Any], *a: Any) -> list[float]:
        assert defaults in configs and len(configs) == 2
        return [0.001 * slower if c == defaults else 0.001 for c in configs]

    monkeypatch.setattr(tune, "side_by_side", side_by_side)
    tuning = pipe.tune(*batch(), loss_fn, progress=False)
    fastest = min(tuning.measured, key=lambda c: c.measured_s or math.inf)
    assert fastest.config != defaults
    assert (tuning.choice == defaults) is kept
    assert any("kept the defaults" in note for note in tuning.notes) is kept
    assert (pipe.chunks, pipe.checkpoint) == (tuning.choice.chunks, tuning.choice.checkpoint)

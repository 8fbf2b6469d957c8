"""planning/price.py: the candidates' space, and gf.plan's fit to measured steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast.api.auto import Config, Cut, Tuned
from gpipe_fast.planning import price
from gpipe_fast.planning.predict import StageCosts
from gpipe_fast.planning.tuning import Fit


@pytest.fixture
def pipe() -> Iterator[Any]:
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    built = gf.GPipe(module, devices=["cpu", "cpu"], schedule="auto", chunks="auto",
                     checkpoint="auto")  # fmt: skip
    yield built
    built.close()


def test_the_first_tuning_tries_every_kind_chunks_and_mode(pipe: Any) -> None:
    tuned = Tuned(True, True, True, cut=True)
    found = price.space(pipe, pipe._auto.builder, tuned, first=True, moves=False, batch=256,
                        layers=8)  # fmt: skip
    assert {kind for kind, _ in found.kinds} == set(gf.schedules())
    cells = dict(found.kinds)
    assert cells["1f1b"] == 2 and cells["interleaved"] == 4 and cells["zbv"] == 4
    assert found.free_cut
    assert found.chunks == [1, 2, 4, 8, 16, 32, 64]  # up to MOST_CHUNKS
    assert found.checkpoints == ["never", "except_last", "always"]


def test_later_tunings_keep_the_cut(pipe: Any) -> None:
    tuned = Tuned(True, True, False, cut=True)
    found = price.space(pipe, pipe._auto.builder, tuned, first=False, moves=False, batch=6,
                        layers=8)  # fmt: skip
    assert found.kinds == [(pipe.schedule, 2)] and not found.free_cut
    assert found.chunks == [1, 2, 3, 4, 6] and found.checkpoints == [pipe.checkpoint]


def test_the_fit_takes_medians() -> None:
    profiled = [StageCosts(1.0, 2.0), StageCosts(1.0, 2.0)]
    samples = [
        (profiled, [StageCosts(2.0, 4.0), StageCosts(2.0, 4.0)], 0.1, 0.01),
        (profiled, [StageCosts(3.0, 6.0), StageCosts(3.0, 6.0)], 0.3, 0.03),
        (profiled, [StageCosts(1.5, 3.0), StageCosts(1.5, 3.0)], 0.2, 0.02),
    ]
    fit = price.fitted(samples)
    assert (fit.scale, fit.handoff, fit.call) == (2.0, 0.2, 0.02)


def test_a_calibrated_prediction_scales_the_profile(pipe: Any) -> None:
    sample = torch.randn(8, 4)
    pricing = price.Pricing(pipe, pipe._auto.builder, sample, 2)
    config = Config(Cut("gpipe", (4, 4)), 2, "never")
    base = pricing.calibrated(config, Fit(1.0, 0.0, 0.0))
    assert pricing.calibrated(config, Fit(2.0, 0.0, 0.0)) == pytest.approx(2 * base)
    assert pricing.calibrated(config, Fit(1.0, 0.0, 0.5)) == pytest.approx(base + 0.5)
    # 2 cells x 2 micro-batches x (forward + backward): a hand-off on each task's path
    assert pricing.calibrated(config, Fit(1.0, 1.0, 0.0)) > base + 4
    # A kind's correction multiplies the whole step, and only that kind's.
    fit = Fit(1.0, 1.0, 0.5, by_kind={"gpipe": 0.8, "1f1b": 3.0})
    plain = pricing.calibrated(config, Fit(1.0, 1.0, 0.5))
    assert pricing.calibrated(config, fit) == pytest.approx(0.8 * plain)


def test_the_measured_plan_shows_the_step_as_it_was_timed(pipe: Any) -> None:
    sample = torch.randn(8, 4)
    pricing = price.Pricing(pipe, pipe._auto.builder, sample, 2)
    config = Config(Cut("1f1b", (4, 4)), 2, "never")
    costs = [StageCosts(0.010, 0.020), StageCosts(0.012, 0.024)]
    plain = pricing.measured_plan(config, costs, 0.0, 0.001)
    # Timed longer than the tasks simulate: the plan keeps its costs (the rest is the
    # handoff's and the call's, which the measurement solved for).
    assert pricing.measured_plan(config, costs, 0.0, 0.001, plain.step_time * 1.2).step_time == (
        pytest.approx(plain.step_time))  # fmt: skip
    # Timed shorter (the tasks overlapped more than their order lets the simulator overlap
    # them): the costs scale so that the plan's step is the one timed, the call kept.
    shorter = pricing.measured_plan(config, costs, 0.0, 0.001, plain.step_time * 0.8)
    assert shorter.step_time == pytest.approx(plain.step_time * 0.8)
    assert shorter.call_overhead == pytest.approx(0.001)
    assert shorter.bubble == pytest.approx(plain.bubble)


@pytest.mark.parametrize("model", ["mlp", "llama"])
def test_the_pricing_profiles_every_layer_set_it_prices_in_rounds(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every profile the candidates are priced from is taken in the rounds (one repeat a
    call), none in a row afterwards: the rounds' layer sets are the pricing's own (GPipe's
    one set of layers; each of gf.pipeline's split points its own)."""
    from gpipe_fast.planning import planner

    calls: list[int] = []
    real = planner.profile_layers

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["repeats"])
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "profile_layers", counted)
    if model == "mlp":
        torch.manual_seed(0)
        layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
        built = gf.GPipe(layers, devices=["cpu", "cpu"], schedule="auto", chunks="auto",
                         checkpoint="auto")  # fmt: skip
        sample: Any = torch.randn(8, 4)
    else:
        pytest.importorskip("transformers")
        from any_model_cases import inputs, llama

        built = gf.pipeline(llama(), inputs("llama", 2, 12, 0), schedule="auto", chunks="auto",
                            checkpoint="auto")  # fmt: skip
        sample = built._as_input(inputs("llama", 4, 12, 1))
    try:
        builder = built._auto.builder
        found = price.space(built, builder, Tuned(True, True, True, cut=True), first=True,
                            moves=False, batch=sample.size(0) if model == "mlp" else 4,
                            layers=builder.most_cells())  # fmt: skip
        pricing = price.Pricing(built, builder, sample, 2)
        ranked = price.candidates(pricing, found, None)
        cuts = {p.config.cut.split_points or p.config.cut.balance for p in ranked.priced}
        assert len(ranked.priced) > 10 and len(cuts) > 1
        assert calls and set(calls) == {1} and len(calls) % price.PROFILE_REPEATS == 0
    finally:
        built.close()

"""The float64 "plain vs pipe" harness: real models (transformers' GPT-2 with a tied head and
LLaMA with rotary skips or tuples, the U-Net) trained through every schedule and layout, in one
process and across processes, against the plain model on the whole batch: losses, every
gradient and the parameters after AdamW steps, to float64's rounding.

The fast form runs by default (every model and schedule; the default checkpoint mode; shared
memory between processes); `pytest --full` adds every checkpoint mode and gloo."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import exact_models
from cluster import Cluster, values

import gpipe_fast as gf
from gpipe_fast import _C

# Stages per worker of each schedule (0: any number; the harness gives such a schedule two).
KINDS = {
    kind.name: kind.stages_per_worker or 2 for kind in _C.schedule_kinds() if not kind.registered
}
BATCHES = [7, 9]  # uneven micro-batches (chunks=3), the size changing between steps
EXACT = 1e-10  # float64 sums in another order differ by ~1e-15; a wrong value by far more
CHECKPOINTS = ("except_last", "always", "never")


def _checkpoints(full: bool) -> tuple[str, ...]:
    return CHECKPOINTS if full else CHECKPOINTS[:1]


def _check(results: list[dict[str, Any]], name: str) -> None:
    """Every process's losses, gradients and parameters equal the plain model's, and between
    them they cover every parameter of it."""
    names: set[str] = set()
    for rank, result in enumerate(results):
        for step, got in enumerate(result["steps"]):
            if got["loss"] is not None:
                assert got["loss"] == pytest.approx(got["plain_loss"], rel=1e-12), (rank, step)
            assert got["grad_error"] < EXACT, (rank, step, got["at"], got["grad_error"])
        assert result["param_error"] < EXACT, (rank, result["param_error"])
        names |= set(result["names"])
    plain = exact_models.CASES[name].build()
    assert names == {key for key, _ in plain.named_parameters(remove_duplicate=False)}
    assert any(r["steps"][0]["loss"] is not None for r in results)


@pytest.mark.parametrize("schedule", list(KINDS))
@pytest.mark.parametrize("name", list(exact_models.CASES))
def test_one_process(name: str, schedule: str, full: bool) -> None:
    workers = 2
    case = exact_models.CASES[name]
    balance = exact_models.even_balance(case.layers, workers * KINDS[schedule])
    for checkpoint in _checkpoints(full):

        def pipe_of(model: torch.nn.Sequential, checkpoint: str = checkpoint) -> gf.GPipe:
            return gf.GPipe(model, balance, devices=["cpu"] * workers, chunks=3,
                            schedule=schedule, checkpoint=checkpoint)  # fmt: skip

        _check([exact_models.train_against_plain(name, pipe_of, BATCHES)], name)


@pytest.mark.parametrize("schedule", list(KINDS))
@pytest.mark.parametrize("name", list(exact_models.CASES))
def test_two_processes(two: Cluster, name: str, schedule: str, full: bool) -> None:
    case = exact_models.CASES[name]
    balance = exact_models.even_balance(case.layers, 2 * KINDS[schedule])
    transports = ("", "gloo") if full else ("",)
    for checkpoint in _checkpoints(full):
        for transport in transports:
            results = values(two.run(
                "dist_cases.with_env", env={"GPIPE_FAST_TRANSPORT": transport},
                case="exact_models.across", model=name, schedule=schedule, balance=balance,
                checkpoint=checkpoint, pp=2, batches=BATCHES,
            ))  # fmt: skip
            _check(results, name)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipeline_and_data_parallel_with_a_weight_tied_across_ranks(
    four: Cluster, schedule: str
) -> None:
    balance = exact_models.even_balance(exact_models.CASES["gpt2"].layers, 2 * KINDS[schedule])
    results = values(four.run("exact_models.across", model="gpt2", schedule=schedule,
                              balance=balance, checkpoint="except_last", pp=2,
                              batches=[8, 12]))  # fmt: skip
    _check(results, "gpt2")

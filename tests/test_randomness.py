"""Randomness: recompute replays forward's dropout masks, and results follow manual_seed only."""

from __future__ import annotations

import copy

import pytest
import randomness_cases as cases
import torch
from cluster import Cluster, values
from torch import nn

import gpipe_fast as gf
from gpipe_fast.nn.randomness import TaskStream

from helpers import mlp


def _step(make_pipe, checkpoint: str, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    module = mlp(4, width=16, dropout=0.5)
    pipe = make_pipe(module, [4, 4, 4], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint)
    torch.manual_seed(seed)
    x = torch.randn(12, 16, dtype=torch.float64)
    out = pipe(x)
    out.sum().backward()
    return out.detach(), [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]


def test_always_and_never_agree_with_the_same_seed(make_pipe) -> None:
    # "never" keeps forward's graph; "always" recomputes it. Equal gradients mean the
    # recompute drew exactly forward's masks, whatever order the threads ran in.
    out_never, grads_never = _step(make_pipe, "never", seed=5)
    out_always, grads_always = _step(make_pipe, "always", seed=5)
    torch.testing.assert_close(out_never, out_always, rtol=0, atol=0)
    for a, b in zip(grads_never, grads_always, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_repeatable_and_seed_dependent(make_pipe) -> None:
    first, _ = _step(make_pipe, "except_last", seed=5)
    again, _ = _step(make_pipe, "except_last", seed=5)
    other, _ = _step(make_pipe, "except_last", seed=6)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, other)


def test_dropout_masks_differ_between_microbatches_and_steps(make_pipe) -> None:
    module = nn.Sequential(nn.Dropout(0.5), nn.Identity())
    pipe = make_pipe(module, [1, 1], devices=["cpu", "cpu"], chunks=2)
    ones = torch.ones(2, 64)
    out = pipe(ones)
    assert not torch.equal(out[0], out[1])  # each micro-batch has its own generator
    assert not torch.equal(out, pipe(ones))  # and each step its own seed


def test_task_stream_is_the_default_generator_seeded_and_put_back() -> None:
    cpu = torch.device("cpu")
    torch.manual_seed(11)
    before = torch.get_rng_state()
    with TaskStream(3, cpu, watch="states") as quiet:
        torch.ones(3).add_(1)
    with TaskStream(3, cpu, watch="states") as noisy:
        a = torch.rand(4)
    with TaskStream(3, cpu):
        b = torch.rand(4)
    assert not quiet.drew and noisy.drew
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, torch.rand(4, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(torch.get_rng_state(), before)  # the caller's generator untouched


def test_task_stream_watching_ops_sees_a_draw_its_states_cannot() -> None:
    # torch.utils.checkpoint restores the generators around its recompute: a draw in there
    # leaves their states as they were, but an op watch sees it.
    cpu = torch.device("cpu")
    with TaskStream(3, cpu, watch="ops") as watched:
        with torch.random.fork_rng():
            torch.rand(2)
    with TaskStream(3, cpu, watch="states") as compared:
        with torch.random.fork_rng():
            torch.rand(2)
    with TaskStream(3, cpu, watch="ops") as quiet:
        torch.ones(2).mul_(2)
    assert watched.drew and not compared.drew and not quiet.drew


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_pass_flags_seen_by_layers(make_pipe, checkpoint: str) -> None:
    seen: list[tuple[bool, bool]] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((gf.is_checkpointing(), gf.is_recomputing()))
            return x * 2

    module = nn.Sequential(nn.Linear(2, 2), Probe())
    pipe = make_pipe(module, [1, 1], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint)
    pipe(torch.randn(3, 2)).sum().backward()
    checkpointed = {"always": 3, "except_last": 2, "never": 0}[checkpoint]
    assert seen.count((True, False)) == checkpointed
    assert seen.count((False, True)) == checkpointed
    assert seen.count((False, False)) == 3 - checkpointed
    assert not gf.is_checkpointing() and not gf.is_recomputing()  # caller's thread untouched


def test_only_cells_that_may_draw_random_numbers_are_probed() -> None:
    from gpipe_fast.nn.randomness import may_draw_random

    class Custom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand_like(x)

    assert not may_draw_random(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.LayerNorm(2)))
    assert may_draw_random(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
    assert may_draw_random(nn.Sequential(nn.RReLU()))
    assert may_draw_random(nn.Sequential(nn.TransformerEncoderLayer(4, 2)))
    assert not may_draw_random(nn.Sequential(nn.MultiheadAttention(4, 2)))
    assert may_draw_random(nn.Sequential(Custom()))


def test_custom_random_layer_is_replayed(make_pipe) -> None:
    class Noise(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rand_like(x)

    outs = []
    for checkpoint in ("never", "always"):
        torch.manual_seed(3)
        module = nn.Sequential(nn.Linear(4, 4), Noise(), nn.Linear(4, 4)).double()
        pipe = make_pipe(module, [2, 1], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
        x = torch.randn(4, 4, dtype=torch.float64)
        out = pipe(x)
        out.sum().backward()
        outs.append((out.detach(), module[0].weight.grad.clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=0)


# -- a model's own checkpoint (torch.utils.checkpoint, gradient checkpointing) ---------------

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv"]
SPLIT = ("zero_bubble", "zbv")


def _cells(schedule: str) -> int:
    return 4 if schedule in ("interleaved", "zbv") else 2


def _checkpointed_step(make_pipe, reentrant: bool | None, schedule: str, checkpoint: str):  # type: ignore[no-untyped-def]
    cells = _cells(schedule)
    module = cases.checkpointed(reentrant, cells)
    balance = [2] + [1] * (cells - 2) + [3]  # of cells + 3 layers
    pipe = make_pipe(module, balance, devices=["cpu"] * cells, chunks=4, checkpoint=checkpoint,
                     schedule=schedule)  # fmt: skip
    x = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(5)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    return loss, [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("checkpoint", ["except_last", "never", "always"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_models_own_checkpoint_replays_its_dropout(make_pipe, reentrant: bool, schedule: str,
                                                     checkpoint: str) -> None:  # fmt: skip
    # The block's torch.utils.checkpoint recomputes in the backward task, restoring the
    # generators it saved in forward: it must draw forward's masks, so the step equals the
    # same pipe without the block's checkpoint, whatever the pipe's own checkpoint mode.
    if reentrant and schedule in SPLIT:
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            _checkpointed_step(make_pipe, reentrant, schedule, checkpoint)
        return
    want_loss, want = _checkpointed_step(make_pipe, None, schedule, checkpoint)
    loss, grads = _checkpointed_step(make_pipe, reentrant, schedule, checkpoint)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)


def _pipeline_step(model: nn.Module, schedule: str, checkpoint: str) -> tuple[float, dict]:  # type: ignore[type-arg]
    blocks = "transformer.h"
    splits = [f"{blocks}.{i}" for i in (1, 2, 3)] if _cells(schedule) == 4 else [f"{blocks}.2"]
    ids = cases.tokens(6, 9, seed=1)
    pipe = gf.pipeline(model, {"input_ids": ids[:2]}, splits, devices=["cpu"] * _cells(schedule),
                       chunks=3, checkpoint=checkpoint, schedule=schedule)  # fmt: skip
    try:
        torch.manual_seed(7)
        loss = pipe.train_step({"input_ids": ids}, ids, cases.token_loss)
    finally:
        pipe.close()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("checkpoint", ["except_last", "never", "always"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpt2_with_dropout_and_gradient_checkpointing(schedule: str, checkpoint: str) -> None:
    # transformers' gradient_checkpointing_enable(): each block's forward checkpointed by the
    # model itself, with dropout in it; exact against the same pipe without it.
    pytest.importorskip("transformers")
    plain = cases.gpt2()
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable()
    want_loss, want = _pipeline_step(plain, schedule, checkpoint)
    loss, grads = _pipeline_step(checkpointed, schedule, checkpoint)
    assert loss == want_loss
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-14, msg=name)
    eval_loss = cases.token_loss(copy.deepcopy(plain).eval()(input_ids=cases.tokens(6, 9, 1)),
                                 cases.tokens(6, 9, 1))  # fmt: skip
    assert loss != pytest.approx(eval_loss.item(), rel=1e-6)  # dropout really drew


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_lora_dropout_under_gradient_checkpointing_at_pp2(two: Cluster, schedule: str) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    runs = {}
    for on in (False, True):
        runs[on] = values(two.run("randomness_cases.lora_pp2", gradient_checkpointing=on,
                                  schedule=schedule, checkpoint="except_last"))  # fmt: skip
    for without, with_ in zip(runs[False], runs[True], strict=True):
        assert with_["loss"] == without["loss"]
        assert with_["grads"].keys() == without["grads"].keys() and with_["grads"]
        for name, grad in without["grads"].items():
            torch.testing.assert_close(torch.tensor(with_["grads"][name]), torch.tensor(grad),
                                       rtol=1e-10, atol=1e-14, msg=name)  # fmt: skip
    assert any("lora" in name for name in runs[True][0]["grads"])


def test_a_mode_set_on_the_model_is_the_cells_mode(make_pipe) -> None:
    # model.eval() reaches the layers, not the cells' own containers: a step in eval mode
    # (no dropout, nothing drawn) must not teach the cell that it never draws.
    grads = []
    for checkpoint in ("never", "always"):
        torch.manual_seed(0)
        module = mlp(4, width=16, dropout=0.5)
        pipe = make_pipe(module, [6, 6], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)
        x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        module.eval()
        pipe.train_step(x, torch.zeros_like(x), nn.functional.mse_loss)
        module.train()
        module.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        pipe.train_step(x, torch.zeros_like(x), nn.functional.mse_loss)
        grads.append([p.grad.clone() for p in module.parameters()])  # type: ignore[union-attr]
    for never, always in zip(*grads, strict=True):
        torch.testing.assert_close(never, always, rtol=0, atol=0)

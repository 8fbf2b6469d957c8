"""gf.ItemMean: an nn.Sequential with CrossEntropyLoss(ignore_index=-100) weighted by the tokens
each micro-batch counts, exact against the plain model on the whole (global) batch in float64
on every schedule, across processes and at pp x dp; and the counting itself."""

from __future__ import annotations

import copy
from typing import Any

import items_cases as cases
import pytest
import torch
from cluster import Cluster, values

import gpipe_fast as gf
from gpipe_fast.nn.items import (
    StepItems,
    check_items_given,
    count_items,
    item_weights,
    step_items,
)

SCHEDULES = gf.builtin_schedules()
MODES = ("never", "except_last", "always")
EXACT = 1e-12


def _pipe(make_pipe: Any, schedule: str, **kwargs: Any) -> tuple[gf.GPipe, Any]:
    model = cases.token_model()
    plain = copy.deepcopy(model)
    devices = ["cpu"] * (2 if schedule in ("interleaved", "zbv") else 4)
    return make_pipe(model, [1] * 4, devices=devices, schedule=schedule, **kwargs), plain


def _assert_grads(pipe: gf.GPipe, plain: torch.nn.Module) -> None:
    for (key, got), want in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=EXACT, atol=EXACT, msg=key)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_cross_entropy_with_ignore_index_equals_the_whole_batch(
    make_pipe: Any, schedule: str, checkpoint: str
) -> None:
    pipe, plain = _pipe(make_pipe, schedule, chunks=3, checkpoint=checkpoint)
    # Rows 3 and 4 count no token: with 7 rows in 3 micro-batches, micro-batch 1 holds them.
    for step, rows in enumerate([(3, 4), (0,)]):
        x, y = cases.token_batch(7, 9, step, empty_rows=rows)
        pipe.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, cases.token_loss, reduction=gf.ItemMean())
        want = cases.token_loss(plain(x), y)
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=EXACT, atol=0)
        _assert_grads(pipe, plain)
        evaluated = pipe.eval_step(x, y, cases.token_loss, reduction=gf.ItemMean())
        torch.testing.assert_close(evaluated, want.detach(), rtol=EXACT, atol=0)


def test_the_rows_mean_keeps_its_meaning_and_differs(make_pipe: Any) -> None:
    # reduction="mean" weighs each micro-batch's mean by its rows: with padding, not the
    # mean over the batch's tokens (what CrossEntropyLoss computes on the whole batch).
    pipe, plain = _pipe(make_pipe, "1f1b", chunks=2)
    x, y = cases.token_batch(6, 9, 4, empty_rows=(1,))
    rows = pipe.eval_step(x, y, cases.token_loss)
    with torch.no_grad():
        halves = [cases.token_loss(plain(x[i : i + 3]), y[i : i + 3]) for i in (0, 3)]
        tokens = cases.token_loss(plain(x), y)
    torch.testing.assert_close(rows, sum(halves) / 2, rtol=EXACT, atol=0)
    assert not torch.allclose(rows, tokens)
    summed = pipe.eval_step(x, y, cases.token_loss, reduction="sum")
    torch.testing.assert_close(summed, sum(halves), rtol=EXACT, atol=0)


@pytest.mark.parametrize("accumulate", [2, 3])
def test_accumulated_steps_and_the_count_of_the_whole_window(
    make_pipe: Any, accumulate: int
) -> None:
    pipe, plain = _pipe(make_pipe, "zbv", chunks=3)
    batches = [cases.token_batch(5 + step, 9, step, empty_rows=(0,)) for step in range(accumulate)]
    # Each step averages over its own tokens; the gradients add up, then are clipped.
    for x, y in batches:
        pipe.train_step(x, y, cases.token_loss, reduction=gf.ItemMean())
        cases.token_loss(plain(x), y).backward()
    norm = pipe.clip_grad_norm_(0.05)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05))
    assert norm > 0.05
    _assert_grads(pipe, plain)
    # num_items_in_batch: every step divides by the tokens of the whole window, as one
    # CrossEntropyLoss over all of its batches would.
    pipe.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    total = sum(int((y != cases.IGNORE).sum()) for _, y in batches)
    losses = [
        pipe.train_step(x, y, cases.token_loss, reduction=gf.ItemMean(),
                        num_items_in_batch=torch.tensor(total))
        for x, y in batches
    ]  # fmt: skip
    xs, ys = zip(*batches, strict=True)
    logits = torch.cat([plain(x).flatten(0, 1) for x in xs])
    want = cases.CRITERION(logits, torch.cat([y.flatten() for y in ys]))
    want.backward()
    torch.testing.assert_close(sum(losses), want.detach(), rtol=EXACT, atol=0)
    _assert_grads(pipe, plain)


def test_a_count_of_ones_own(make_pipe: Any) -> None:
    # A loss that shifts its target: the items are the target's entries from the second on.
    def shifted(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cases.token_loss(logits[:, :-1], target[:, 1:])

    pipe, plain = _pipe(make_pipe, "gpipe", chunks=3)
    x, y = cases.token_batch(7, 9, 5, empty_rows=(2,))
    y[5, 1:] = cases.IGNORE  # a row whose only counted token is the unshifted first
    mean = gf.ItemMean(count=lambda target: (target[:, 1:] != cases.IGNORE).sum())
    loss = pipe.train_step(x, y, shifted, reduction=mean)
    want = shifted(plain(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=EXACT, atol=0)
    _assert_grads(pipe, plain)


def test_an_empty_pipe(make_pipe: Any) -> None:
    pipe = make_pipe(torch.nn.Sequential(), [])
    logits = torch.randn(4, 3, cases.VOCAB, dtype=torch.float64, requires_grad=True)
    _, y = cases.token_batch(4, 3, 6)
    loss = pipe.train_step(logits, y, cases.token_loss, reduction=gf.ItemMean(),
                           num_items_in_batch=50)  # fmt: skip
    want = cases.CRITERION(logits.flatten(0, 1), y.flatten()) * (int((y != -100).sum()) / 50)
    torch.testing.assert_close(loss, want.detach())


def test_bad_reductions_and_counts_are_named(make_pipe: Any) -> None:
    pipe, _ = _pipe(make_pipe, "1f1b", chunks=2)
    x, y = cases.token_batch(4, 5, 7)
    with pytest.raises(ValueError, match=r"reduction must be one of \('mean', 'sum'\) or"):
        pipe.train_step(x, y, cases.token_loss, reduction="max")
    with pytest.raises(ValueError, match="num_items_in_batch divides a mean over counted"):
        pipe.train_step(x, y, cases.token_loss, num_items_in_batch=10)
    with pytest.raises(TypeError, match="num_items_in_batch must be an int"):
        pipe.train_step(x, y, cases.token_loss, reduction=gf.ItemMean(), num_items_in_batch=2.5)
    with pytest.raises(ValueError, match="0-dim integer tensor"):
        pipe.eval_step(x, y, cases.token_loss, reduction=gf.ItemMean(),
                       num_items_in_batch=torch.ones(2, dtype=torch.long))  # fmt: skip
    with pytest.raises(ValueError, match="micro-batch 0's items must be a whole number >= 0"):
        pipe.eval_step(x, y, cases.token_loss, reduction=gf.ItemMean(count=lambda t: -1))
    tuple_loss = lambda out, target: cases.token_loss(out, target[0])  # noqa: E731
    with pytest.raises(TypeError, match=r"give ItemMean\(count=...\)"):
        pipe.eval_step(x, (y, y), tuple_loss, reduction=gf.ItemMean())
    counted = gf.ItemMean(count=lambda target: (target[0] != -100).sum())
    torch.testing.assert_close(
        pipe.eval_step(x, (y, y), tuple_loss, reduction=counted),
        pipe.eval_step(x, y, cases.token_loss, reduction=gf.ItemMean()),
    )
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        gf.ItemMean(ignore_index=-100.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="count must be callable"):
        gf.ItemMean(count=3)  # type: ignore[arg-type]


def test_counting_weights_and_the_count_given() -> None:
    labels = [torch.tensor([[1, -100], [2, 3]]), torch.full((2, 2), -100)]
    counter = gf.ItemMean().counter()
    assert count_items(counter, labels) == [3, 0]
    assert count_items(lambda value: value, [2, torch.tensor(5)]) == [2, 5]
    with pytest.raises(TypeError, match="micro-batch 1's items must be an int"):
        count_items(lambda value: value, [1, "two"])
    with pytest.raises(ValueError, match="whole number"):
        count_items(lambda value: value, [1.5])
    assert check_items_given(None) is None and check_items_given(torch.tensor(7)) == 7
    with pytest.raises(TypeError, match="num_items_in_batch must be an int or None"):
        check_items_given(True)
    items = StepItems([3, 0, 1], 8)
    assert item_weights(items, divided=False) == [3 / 8, 0.0, 1 / 8]
    assert item_weights(items, divided=True) == [1.0, 0.0, 1.0]
    assert step_items([3, 0], 3, None) == StepItems([3, 0], 3)
    assert step_items([3, 0], 9, 20) == StepItems([3, 0], 20)
    with pytest.raises(ValueError, match="num_items_in_batch is 2, but this step's batch"):
        step_items([3, 0], 3, 2)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_two_processes(two: Cluster, schedule: str) -> None:
    batches = [cases.token_batch(7, 9, step, empty_rows=(3, 4)) for step in range(4)]
    results = values(two.run("items_cases.sequential_across", pp=2, schedule=schedule,
                             batches=batches, accumulate=2))  # fmt: skip
    _check_across(results)


def test_pipeline_and_data_parallel_with_lopsided_replicas(four: Cluster) -> None:
    # Replica 0's rows count one token each, replica 1's all of theirs.
    batches = []
    for step in range(4):
        x, y = cases.token_batch(8, 9, step)
        y[:4, 1:] = cases.IGNORE
        batches.append((x, y))
    results = values(four.run("items_cases.sequential_across", pp=2, schedule="1f1b",
                              batches=batches, accumulate=2))  # fmt: skip
    _check_across(results)


def _check_across(results: list[dict[str, Any]]) -> None:
    for result in results:
        for loss, want in result["losses"]:
            assert loss == pytest.approx(want, rel=EXACT)
        assert max(result["errors"]) < EXACT


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu(make_pipe: Any) -> None:
    # Two cells on one GPU (zbv: four), the target counted where it lies, on the GPU.
    model = cases.token_model().cuda()
    plain = copy.deepcopy(model)
    pipe = make_pipe(model, [1] * 4, devices=["cuda:0"] * 2, chunks=3, schedule="zbv")
    x, y = (t.cuda() for t in cases.token_batch(7, 9, 0, empty_rows=(3, 4)))
    loss = pipe.train_step(x, y, cases.token_loss, reduction=gf.ItemMean())
    want = cases.token_loss(plain(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=EXACT, atol=0)
    _assert_grads(pipe, plain)

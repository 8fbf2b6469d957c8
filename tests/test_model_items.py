"""A transformers model's own loss from padded `labels` through gf.pipeline (target None): the
mean over the labels that are not -100, exact against the plain model on the whole global
batch in float64 (GPT-2 with its tied head and LLaMA, given num_items_in_batch; T5 and BERT,
weighted by their labels), on every schedule, across processes, at pp x dp with replicas of
very different counts, over accumulated steps with clipping, and with rows and micro-batches
that count nothing."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import any_model_cases as models
import items_cases as cases
from cluster import Cluster, values

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.api.model_items import model_loss

KINDS = {
    kind.name: kind.stages_per_worker or 2 for kind in _C.schedule_kinds() if not kind.registered
}
# Uneven micro-batches (chunks=3); rows 3 and 4 count nothing: with 7 rows, micro-batch 1
# holds exactly them.
SHAPES = [(7, 8), (5, 11)]
EMPTY = (3, 4)
WEIGHTED = ("t5", "bert")  # forwards that compute their own mean: weighted, with a warning


def _one_process(name: str, schedule: str = "1f1b", checkpoint: str = "except_last") -> Any:
    stages = 3 if name == "t5" else 2 * KINDS[schedule]

    def make(model: nn.Module, example: dict[str, Any]) -> Any:
        return gf.pipeline(model, example, models.split_points(name, stages), chunks=3,
                           devices=["cpu"] * (3 if name == "t5" else 2), schedule=schedule,
                           checkpoint=checkpoint)  # fmt: skip

    return make


def _run(name: str, make: Any, batches: Any, **options: Any) -> dict[str, Any]:
    """own_loss_against_plain, with the warning a weighted model gives (once per pipe)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = cases.own_loss_against_plain(name, make, batches, **options)
    said = [str(w.message) for w in caught if "num_items_in_batch" in str(w.message)]
    assert len(said) == (1 if name in WEIGHTED else 0), said
    return result


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "bert"])
def test_padded_labels_equal_the_whole_batch(name: str) -> None:
    batches = cases.uneven_batches(name, SHAPES, EMPTY)
    cases.check_own_loss(_run(name, _one_process(name), batches, evaluate=True))


@pytest.mark.parametrize("schedule", list(KINDS))
def test_every_schedule(schedule: str) -> None:
    batches = cases.uneven_batches("gpt2", SHAPES, EMPTY)
    for checkpoint in ("except_last", "always", "never"):
        make = _one_process("gpt2", schedule, checkpoint)
        cases.check_own_loss(_run("gpt2", make, batches))


@pytest.mark.parametrize("name", ["gpt2", "t5"])
@pytest.mark.parametrize("accumulate", [2, 3])
def test_accumulated_steps_each_average_their_own_items_and_clip_after(
    name: str, accumulate: int
) -> None:
    shapes = [(7, 8), (5, 11), (6, 9)][:accumulate] * 2
    batches = cases.uneven_batches(name, shapes, (0,))
    result = _run(name, _one_process(name), batches, accumulate=accumulate, clip=0.05)
    cases.check_own_loss(result)
    # The clipping bit: the norm was over 0.05, so the gradients were scaled.
    assert all(step["norms"][1] > 0.05 for step in result["steps"] if step["norms"])


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_num_items_in_batch_over_accumulated_steps_as_the_trainer_counts(name: str) -> None:
    # Each step divides by the items of the whole window of 3 (the model is given the count
    # where its forward takes it): the window's gradient is the mean over all its items.
    batches = cases.uneven_batches(name, [(7, 8), (5, 11), (6, 9)], (0,))
    cases.check_own_loss(_run(name, _one_process(name), batches, accumulate=3, given=True))


def test_a_micro_batch_and_a_whole_batch_without_items() -> None:
    model = models.gpt2()
    plain = copy.deepcopy(model)
    batch = cases.padded_inputs("gpt2", 6, 8, 3, empty_rows=(0, 1))
    pipe = gf.pipeline(model, batch, ["transformer.h.2"], chunks=3, devices=["cpu"] * 2)
    try:
        loss = pipe.train_step(batch, None, cases.own_loss)
        want = plain(**batch).loss
        want.backward()
        assert loss.item() == pytest.approx(want.item(), rel=cases.LOSS_TOLERANCE)
        grads = dict(plain.named_parameters())
        for key, param in pipe.named_parameters():
            assert models.relative(param.grad, grads[key].grad) < cases.EXACT, key
        # No item at all: the plain model's mean is 0/0; the pipe's too, and no gradient moves.
        nothing = {**batch, "labels": torch.full_like(batch["labels"], cases.IGNORE)}
        before = {key: param.grad.clone() for key, param in pipe.named_parameters()}
        loss = pipe.train_step(nothing, None, cases.own_loss)
        assert torch.isnan(loss) and torch.isnan(plain(**nothing).loss)
        for key, param in pipe.named_parameters():
            assert torch.equal(param.grad, before[key]), key
    finally:
        pipe.close()


@pytest.mark.parametrize("name", ["gpt2", "t5"])
@pytest.mark.parametrize("transport", ["", "gloo"])
def test_two_processes(two: Cluster, name: str, transport: str) -> None:
    # Over shared memory the items travel on the rings' control lane, over gloo in an
    # all-reduce of the pipeline group.
    batches = cases.uneven_batches(name, SHAPES, EMPTY)
    results = values(two.run(
        "dist_cases.with_env", env={"GPIPE_FAST_TRANSPORT": transport},
        case="items_cases.across", model=name, schedule="1f1b", stages=2, pp=2,
        batches=batches, accumulate=2, clip=0.05,
    ))  # fmt: skip
    for result in results:
        cases.check_own_loss(result)


@pytest.mark.parametrize(("name", "dp_shard"), [("gpt2", False), ("bert", False), ("gpt2", True)])
def test_pipeline_and_data_parallel_with_lopsided_replicas(
    four: Cluster, name: str, dp_shard: bool
) -> None:
    # Replica 0 counts 2 labels a row, replica 1 nearly all: each rank's gradients are those
    # of the whole global batch, whose mean is over both replicas' items together (replicated
    # stages, or stages sharded over the replicas with FSDP2).
    batches = [cases.lopsided_batch(name, 8, 10, step) for step in range(4)]
    results = values(four.run(
        "items_cases.across", model=name, schedule="1f1b", stages=2, pp=2, batches=batches,
        dp_shard=dp_shard, accumulate=2, clip=0.05, evaluate=True,
    ))  # fmt: skip
    for result in results:
        cases.check_own_loss(result)


def test_how_models_count_their_items() -> None:
    assert model_loss(models.gpt2()) == gf.api.model_items.ModelLoss(
        "GPT2LMHeadModel", shifts=True, takes_count=True
    )
    llama = model_loss(models.llama())
    assert llama is not None and llama.shifts and llama.takes_count
    t5 = model_loss(models.t5())  # its labels are the decoder's targets as they are
    assert t5 is not None and not t5.shifts and not t5.takes_count
    bert = model_loss(models.bert())
    assert bert is not None and not bert.shifts and not bert.takes_count
    assert model_loss(models.vision()) is None  # not a transformers model


def test_the_count_given_is_taken_back_after_each_step() -> None:
    model = models.gpt2()
    batch = cases.padded_inputs("gpt2", 4, 8, 5)
    pipe = gf.pipeline(model, batch, ["transformer.h.2"], chunks=2, devices=["cpu"] * 2)
    try:
        pipe.train_step(batch, None, cases.own_loss)
        assert pipe._last_stage.loss_kwargs == {}
        with pytest.raises(TypeError, match="loss_fn must return a scalar"):
            pipe.train_step(batch, None, lambda output, _: output.logits)
        assert pipe._last_stage.loss_kwargs == {}
    finally:
        pipe.close()


def test_other_models_and_explicit_reductions() -> None:
    model = models.llama()
    plain = copy.deepcopy(model)
    batch = cases.padded_inputs("llama", 6, 8, 7)
    pipe = gf.pipeline(model, batch, ["model.layers.2"], chunks=3, devices=["cpu"] * 2)
    try:
        # reduction="mean" keeps its meaning: each micro-batch's loss weighs its rows.
        rows = pipe.eval_step(batch, None, cases.own_loss, reduction="mean")
        pieces = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2, 4)]
        with torch.no_grad():
            want = sum(plain(**piece).loss for piece in pieces) / 3
        assert rows.item() == pytest.approx(want.item(), rel=cases.LOSS_TOLERANCE)
        # gf.ItemMean(count=...) counts the labels as the caller says (here: as the model).
        shifted = gf.ItemMean(count=lambda labels: (labels[:, 1:] != -100).sum())
        counted = pipe.eval_step(batch, None, cases.own_loss, reduction=shifted)
        with torch.no_grad():
            assert counted.item() == pytest.approx(plain(**batch).loss.item(), rel=1e-6)
        with pytest.raises(ValueError, match="num_items_in_batch must be > 0"):
            pipe.train_step(batch, None, cases.own_loss, num_items_in_batch=0)
        with pytest.raises(ValueError, match="this step's batch alone counts"):
            pipe.train_step(batch, None, cases.own_loss, num_items_in_batch=1)
        with pytest.raises(ValueError, match=r"reduction=gf\.ItemMean"):
            pipe.train_step(batch, None, cases.own_loss, reduction="sum", num_items_in_batch=9)
        no_labels = {"input_ids": batch["input_ids"]}
        with pytest.raises(ValueError, match="the inputs hold no 'labels'"):
            pipe.eval_step(no_labels, None, lambda o, _: o.logits.sum(), reduction=gf.ItemMean())
        with pytest.raises(ValueError, match="the inputs hold no labels to count"):
            pipe.eval_step(no_labels, None, lambda o, _: o.logits.sum(), num_items_in_batch=9)
    finally:
        pipe.close()


def test_a_model_of_its_own_weighs_rows_unless_told() -> None:
    # Not a transformers model: the pipe cannot know what its loss averages over.
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(cases.VOCAB, 8)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
            self.head = nn.Linear(8, cases.VOCAB)

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(ids)
            for block in self.blocks:
                hidden = block(hidden)
            return cases.token_loss(self.head(hidden), labels)

    torch.manual_seed(0)
    model = Tagger().double()
    plain = copy.deepcopy(model)
    ids, labels = cases.token_batch(6, 8, 2, empty_rows=(2, 3))
    pipe = gf.pipeline(model, {"ids": ids, "labels": labels}, ["blocks.1"], chunks=3,
                       devices=["cpu"] * 2)  # fmt: skip
    try:
        batch = {"ids": ids, "labels": labels}
        loss = pipe.train_step(batch, None, lambda out, _: out, reduction=gf.ItemMean())
        want = plain(ids, labels)
        want.backward()
        assert loss.item() == pytest.approx(want.item(), rel=1e-12)
        grads = dict(plain.named_parameters())
        for key, param in pipe.named_parameters():
            assert models.relative(param.grad, grads[key].grad) < cases.EXACT, key
        # The default weighs rows: a micro-batch without items (rows 2, 3) has a NaN mean.
        assert torch.isnan(pipe.eval_step(batch, None, lambda out, _: out))
    finally:
        pipe.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_padded_labels_on_a_gpu(name: str) -> None:
    # The labels counted on the GPU, the count given to the model there (GPT-2) or weighed.
    padded = cases.uneven_batches(name, SHAPES, EMPTY)
    batches = [{key: value.cuda() for key, value in batch.items()} for batch in padded]

    def make(model: nn.Module, example: dict[str, Any]) -> Any:
        return gf.pipeline(model, example, models.split_points(name, 3 if name == "t5" else 2),
                           chunks=3, devices=["cuda:0"] * (3 if name == "t5" else 2))  # fmt: skip

    cases.check_own_loss(_run(name, make, batches, evaluate=True, device="cuda"))
